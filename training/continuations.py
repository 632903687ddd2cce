"""Continuation prompts from the running Python's standard library (PSF licence), offline:
code snippets from its source files and prose from its documentation (`pydoc_data`'s topic
pages where installed, and docstrings read with `ast`, never imported).

Four sources of `n` prompts each, every snippet used once:
  continue_code   a chat request to continue a code snippet
  raw_code        a snippet alone, no chat template: the target continues the file
  continue_prose  a chat request to continue a passage of documentation
  raw_prose       a passage alone, continued as plain text
A snippet starts at a `def`/`class` line when the file has one and runs 6-30 lines; a passage
is 1-3 consecutive paragraphs of 120-1,200 characters. Deterministic for one Python version
and seed.
"""

from __future__ import annotations

import ast
import logging
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

from ddserve.training.prompts import Prompt

log = logging.getLogger(__name__)

SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
SKIP |= {"tkinter", "ensurepip", "dist-packages", "encodings"}  # encodings: near-identical tables
CODE_REQUESTS = [
    "Continue this Python code:\n\n```python\n{s}\n```",
    "Complete the following code. Continue exactly from where it stops.\n\n{s}",
    "What comes next? Continue writing this program:\n\n{s}",
    "Here is the start of a Python module. Write the rest of it.\n\n```python\n{s}\n```",
]
PROSE_REQUESTS = [
    "Continue this text:\n\n{s}",
    "Write the next paragraph of this document:\n\n{s}",
    "Here is part of a technical document. Continue it in the same style.\n\n{s}",
    "Continue writing:\n\n{s}",
]


@lru_cache(maxsize=1)
def stdlib_sources() -> tuple[str, ...]:
    """The text of every standard-library source file (tests, GUI modules and codec tables left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not SKIP & set(p.relative_to(root).parts)]
    if not files:
        log.warning("no standard-library sources under %s: no continuation prompts", root)
    return tuple(p.read_text(errors="ignore") for p in files)


def code_snippets(n: int, rng: random.Random) -> list[str]:
    """Up to `n` distinct snippets of 6-30 lines (at most 1,500 characters)."""
    texts = [t.splitlines() for t in stdlib_sources() if t.count("\n") > 10]
    starts = [
        [i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class "))]
        for lines in texts
    ]
    out: dict[str, None] = {}
    for _ in range(4 * n):
        if len(out) >= n or not texts:
            break
        f = rng.randrange(len(texts))
        lines = texts[f]
        start = rng.choice(starts[f]) if starts[f] else rng.randrange(len(lines))
        snippet = "\n".join(lines[start : start + rng.randint(6, 30)]).rstrip()[:1500]
        if sum(1 for ln in snippet.splitlines() if ln.strip()) >= 3:
            out[snippet] = None
    return list(out)


def paragraphs(n_docs: int, rng: random.Random) -> list[tuple[str, ...]]:
    """Documentation as runs of paragraphs (split at blank lines): pydoc's topic pages and
    the docstrings of 200+ characters of source files taken in random order until there are
    `n_docs` (parsing the whole library costs seconds)."""
    docs = []
    try:
        from pydoc_data.topics import topics

        docs += [topics[k] for k in sorted(topics)]
    except ImportError:  # some distributions package pydoc_data separately
        pass
    sources = list(stdlib_sources())
    rng.shuffle(sources)
    for text in sources:
        if len(docs) >= n_docs:
            break
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    docs.append(doc)
    out = []
    for doc in docs:
        paras = tuple(p.strip() for p in doc.split("\n\n") if len(p.strip()) >= 40)
        if paras:
            out.append(paras)
    return out


def prose_passages(n: int, rng: random.Random) -> list[str]:
    """Up to `n` distinct passages of 1-3 consecutive paragraphs (120-1,200 characters)."""
    docs = paragraphs(max(64, n // 4), rng)  # a doc gives several passages
    out: dict[str, None] = {}
    for _ in range(4 * n):
        if len(out) >= n or not docs:
            break
        paras = rng.choice(docs)
        i = rng.randrange(len(paras))
        passage = "\n\n".join(paras[i : i + rng.randint(1, 3)])[:1200]
        if len(passage) >= 120:
            out[passage] = None
    return list(out)


def continuation_prompts(n: int, seed: int = 0) -> dict[str, list[Prompt]]:
    """The four continuation sources, `n` prompts each at most (fewer if the library has
    fewer distinct snippets)."""
    rng = random.Random(seed)
    code = code_snippets(2 * n, rng)
    prose = prose_passages(2 * n, rng)
    return {
        "continue_code": [
            Prompt(rng.choice(CODE_REQUESTS).format(s=s), "continue_code") for s in code[::2]
        ],
        "raw_code": [Prompt(s + "\n", "raw_code", chat=False) for s in code[1::2]],
        "continue_prose": [
            Prompt(rng.choice(PROSE_REQUESTS).format(s=s), "continue_prose") for s in prose[::2]
        ],
        "raw_prose": [Prompt(s + "\n\n", "raw_prose", chat=False) for s in prose[1::2]],
    }
