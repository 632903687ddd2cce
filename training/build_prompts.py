"""Build training/data/stdlib_prompts.jsonl.gz: chat prompts made from the docstrings of the
Python standard library (PSF licence), for a corpus more diverse than the templated chat set.

    python -m ddserve.training.build_prompts   # deterministic for one Python version (3.11 here)
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import pkgutil
import random
import sys
import warnings
from pathlib import Path

OUT = Path(__file__).parent / "data" / "stdlib_prompts.jsonl.gz"
SKIP = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "antigravity", "this")
TEMPLATES = [
    "Explain what `{name}` does in Python, with a short example.\n\nDocumentation:\n{doc}",
    "Summarize this Python documentation in plain language:\n\n{doc}",
    "Write a short Python program that uses `{name}`. Its documentation:\n\n{doc}",
    "What are common mistakes when using `{name}`? Documentation:\n\n{doc}",
    "Rewrite this documentation for a beginner:\n\n{doc}",
    "Write unit tests for `{name}`, whose documentation says:\n\n{doc}",
]


def docstrings() -> list[tuple[str, str]]:
    out = []
    stdlib = [m for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix)]
    names = []
    for m in stdlib:
        if m.name.startswith("_") or m.name in SKIP or "site-packages" in m.module_finder.path:
            continue
        names.append(m.name)
        if m.ispkg:
            path = [str(Path(m.module_finder.path) / m.name)]
            names += [f"{m.name}.{s.name}" for s in pkgutil.iter_modules(path)]
    for mod_name in sorted(set(names)):
        if any(part.startswith("_") or part in SKIP for part in mod_name.split(".")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # some stdlib modules need optional system libraries
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            if 80 <= len(doc):
                out.append((f"{mod_name}.{attr}", doc[:700]))
            if inspect.isclass(obj):
                for meth, fn in sorted(vars(obj).items()):
                    mdoc = inspect.getdoc(fn) if inspect.isfunction(fn) else None
                    if not meth.startswith("_") and mdoc and len(mdoc) >= 80:
                        out.append((f"{mod_name}.{attr}.{meth}", mdoc[:700]))
    return out


def main() -> None:
    rng = random.Random(0)
    prompts = [rng.choice(TEMPLATES).format(name=n, doc=d) for n, d in docstrings()]
    OUT.parent.mkdir(exist_ok=True)
    with gzip.open(OUT, "wt") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} prompts -> {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
