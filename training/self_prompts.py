"""Prompts the target writes itself: its chat template rendered up to an opened user turn, and
the target samples the user's message (T ~ 1) until its end of turn.

`writer(seed)` draws everything from Random(seed) alone:
  * no hint (15%): the template's own system turn (its default), then the user turn
  * an opening word only (15%), e.g. "How" or "Write", which the message continues
  (both count as chat)
  * a system hint (70%) naming who the user is, what kind of message it is (a question, a
    poem request, a function in some language, ...), on which topic and in which style,
    sometimes with an opening word too
A message is kept when it ended with the end of turn, has `min_tokens`..`max_tokens` tokens,
holds no template markers and its normalized text is new (not kept already, not excluded).
Code kinds make `self_code` prompts, the others `self_chat`; held-out writers draw chat kinds
only. Training and held-out writers use disjoint seed ranges (`training_seeds`,
`heldout_seeds`), and training drops any message whose text a held-out one has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ddserve.training.prompts import SUBJECTS, Prompt, normalized

SEED_RANGE = 1 << 31  # seeds per range: training [k*2^32, k*2^32+2^31), held out the next half
SENTINEL = "\x00USER-MESSAGE\x00"
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>")

TOPICS = (
    [s.strip() for s in SUBJECTS]
    + """a birthday party; moving to a new city; a broken
laptop; learning the piano; a job offer; a rainy weekend; a used car; a wedding speech; a
garden full of weeds; a noisy neighbour; a first date; a science fair; a school project;
a marathon training plan; a vegetarian diet; a trip to Japan; a hiking trail; a lost wallet;
a board game night; a podcast; a mobile app idea; a cover letter; a landlord; a cat that
will not eat; houseplants; saving for retirement; a credit card bill; a flight delay;
a team meeting; a product launch; customer complaints; a spreadsheet; a résumé;
a history exam; a chemistry lab; fractions; geometry; statistics; a novel; a movie review;
a song; a painting class; a photography trip; knitting; woodworking; a bicycle repair;
a smart home; passwords; a phishing email; a website; a chatbot; a video game; a football
match; basketball; yoga; a cold; allergies; a dentist visit; a job interview; a promotion;
a difficult coworker; a volunteer project; a charity event; a wedding; a holiday dinner;
a picnic; a camping trip; a thunderstorm; a power outage; a city council; elections;
a local library; a museum visit; a zoo; a farm; a bakery; a coffee shop; a restaurant menu;
a grocery list; meal prep; a budget spreadsheet; a car loan; a mortgage; a side hustle;
a startup pitch; a marketing plan; a logo; a newsletter; a blog post; a wiki page""".split(";")
)
TOPICS = [" ".join(t.split()) for t in TOPICS]

PERSONAS = """a student; a teacher; a software engineer; a nurse; a small business owner;
a retiree; a teenager; a data scientist; a traveler; a parent; a researcher; a writer;
a beginner programmer; a chef; a lawyer; a farmer; a musician; a manager; a journalist;
a doctor; an artist; a mechanic; an accountant; a designer; a scientist; a shop assistant;
someone learning English; a job seeker; a hobbyist; a gamer""".split(";")
PERSONAS = [" ".join(p.split()) for p in PERSONAS]

CHAT_KINDS = [
    "a question about {topic}",
    "a request to explain {topic} simply",
    "a request for a short poem about {topic}",
    "a request for a short story involving {topic}",
    "a request for advice about {topic}",
    "a request to write an email about {topic}",
    "a request to summarize a paragraph about {topic}, with the paragraph included",
    "a request to translate a sentence about {topic} into {language}",
    "a math word problem about {topic}",
    "a request for a list of ideas about {topic}",
    "a request to compare two things related to {topic}",
    "a request to rewrite a sentence about {topic} more formally, with the sentence included",
    "a request for a quiz about {topic}",
    "a request for a step-by-step plan involving {topic}",
    "a yes-or-no question about {topic}",
    "a request to fix the grammar of a sentence about {topic}, with the sentence included",
    "a request for arguments for and against something about {topic}",
    "a request for a social media post about {topic}",
    "a request for a recipe that fits {topic}",
    "a request for a dialogue between two people about {topic}",
    "a request to classify or sort a few items related to {topic}",
    "a request for a definition of a term related to {topic}",
    "a request for a joke about {topic}",
    "a request to role-play a conversation about {topic}",
    "a request for a product description related to {topic}",
    "a request to extract facts from a short text about {topic}, with the text included",
]
CODE_KINDS = [
    "a request for a {lang} function that has to do with {topic}",
    "a request for a {lang} function that {task}",
    "a question about an error in {lang} code, with the code included",
    "a request to explain a {lang} snippet, with the snippet included",
    "a request to refactor some {lang} code, with the code included",
    "a request for unit tests of a {lang} function that {task}",
    "a request for a class in {lang} that models {topic}",
    "a request for a SQL query about {topic}",
    "a request for a shell command that {task}",
    "a question about the time complexity of a {lang} function, with the function included",
    "a request to add comments and type hints to {lang} code, with the code included",
    "a request for a {lang} script that {task}",
]
TASKS = """parses dates; sorts records by two keys; reads a CSV file; counts words; validates
an email address; merges two dictionaries; finds duplicates in a list; computes a moving
average; downloads a web page; renames files in a folder; checks for balanced brackets;
converts Roman numerals; implements a queue; caches results; retries on failure; parses
command-line arguments; computes statistics of a list; formats a table; generates
passwords; finds the shortest path in a graph; reverses a linked list; tokenizes a sentence;
compresses a string; flattens nested lists; schedules tasks; reads JSON; writes a log file;
computes prime numbers; simulates a dice game; converts units""".split(";")
TASKS = [" ".join(t.split()) for t in TASKS]
LANGS = ["Python"] * 6 + ["JavaScript", "TypeScript", "C", "C++", "Rust", "Go", "Java", "Bash"]
LANGS += ["Ruby", "Kotlin", "C#", "PHP", "Haskell", "R"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Chinese"]
STYLES = [
    "short",
    "detailed",
    "casual",
    "polite",
    "one sentence long",
    "informal, with a small typo",
    "specific, with concrete details",
    "a little confused",
    "enthusiastic",
    "in the form of a numbered list of requirements",
]
OPENERS = "How;What;Why;Can you;Could you;Write;Explain;Please;I need;Give me;Help me;Is it"
OPENERS += ";Tell me;Create;Describe;List;Summarize;Translate;Fix;Compare;Suggest;I'm;My;Which"
OPENERS = OPENERS.split(";")


@dataclass(frozen=True)
class Writer:
    """How one self-written prompt is drawn: the system hint (None: the template's default),
    the message's opening words, and the domain of the kind of message asked for."""

    seed: int
    system: str | None
    opener: str
    domain: str


def training_seeds(n: int, seed: int = 0) -> range:
    base = seed * (2 * SEED_RANGE)
    return range(base, base + min(n, SEED_RANGE))


def heldout_seeds(n: int, seed: int = 0) -> range:
    base = seed * (2 * SEED_RANGE) + SEED_RANGE
    return range(base, base + min(n, SEED_RANGE))


def writer(seed: int, code_share: float = 0.25) -> Writer:
    """The writer of seed `seed` (see the module docstring for the draw)."""
    rng = random.Random(seed)
    mode = rng.random()
    code = rng.random() < code_share
    if mode < 0.15:  # no hint: whatever the target writes counts as chat
        return Writer(seed, None, "", "chat")
    if mode < 0.30:
        return Writer(seed, None, rng.choice(OPENERS), "chat")
    kind = rng.choice(CODE_KINDS if code else CHAT_KINDS).format(
        topic=rng.choice(TOPICS),
        lang=rng.choice(LANGS),
        task=rng.choice(TASKS),
        language=rng.choice(LANGUAGES),
    )
    system = (
        "You write the message a user sends to an AI assistant, and nothing else. "
        f"The user is {rng.choice(PERSONAS)}. The message is {kind}. "
        f"Keep it {rng.choice(STYLES)}."
    )
    opener = rng.choice(OPENERS) if rng.random() < 0.3 else ""
    return Writer(seed, system, opener, "code" if code else "chat")


def opened_user_turn(tokenizer, system: str | None) -> str:
    """The chat template's text up to where the user's message begins."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    return text[: text.index(SENTINEL)]


def writer_ids(tokenizer, w: Writer) -> list[int]:
    """The prompt the target continues to write the message: the opened user turn and the
    opening words."""
    text = opened_user_turn(tokenizer, w.system) + w.opener
    return list(tokenizer.encode(text, add_special_tokens=False))


def written_text(
    tokenizer,
    w: Writer,
    tokens: list[int],
    finish_reason: str | None,
    eos: set[int],
    min_tokens: int = 4,
    max_tokens: int = 160,
) -> str | None:
    """The user message the target wrote, or None if it is not kept (unfinished, too short
    or long, holding template markers)."""
    if finish_reason != "stop" or not tokens or tokens[-1] not in eos:
        return None
    if not min_tokens <= len(tokens) - 1 <= max_tokens:
        return None
    text = (w.opener + tokenizer.decode(tokens[:-1])).strip()
    if len(text) < 12 or any(m in text for m in MARKERS):
        return None
    return text


def collect(
    writers: list[Writer], texts: list[str | None], exclude: set[str], source_of: dict[str, str]
) -> list[Prompt]:
    """Kept messages as prompts (source by the writer's domain via `source_of`), without
    repeats and without any whose normalized text is in `exclude`."""
    seen, out = set(exclude), []
    for w, text in zip(writers, texts, strict=True):
        if text is None or (key := normalized(text)) in seen:
            continue
        seen.add(key)
        out.append(Prompt(text, source_of[w.domain]))
    return out
