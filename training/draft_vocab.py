"""The drafter's vocabulary subset: the most frequent target tokens, so drafting computes the
LM head over K rows instead of the whole vocabulary (on a 2-core CPU the full 49,152-row head
costs ~10 ms per draft, a fifth of a target step). Verification is untouched, so output stays
lossless; a target token outside the subset can only be the bonus token, never a draft.

    python -m ddserve.training.draft_vocab --model smollm2-135m --k 16384 --out DIR

Frequencies: the drafter's training prompts plus the Python standard library's own source
(code and English prose, both on this machine); EOS and special tokens are always kept.
Writes DIR/draft_vocab.safetensors (token_ids, int64, ascending).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddserve.engine.weights import load_tokenizer
from ddserve.training.prompts import training_prompts


def texts(max_bytes: int) -> list[str]:
    out = list(training_prompts(100000))
    size = sum(map(len, out))
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    for path in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py")):
        if "test" in path.parts or size > max_bytes:
            continue
        t = path.read_text(errors="ignore")
        out.append(t)
        size += len(t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--max-bytes", type=int, default=12_000_000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.model)
    counts = collections.Counter()
    for t in texts(a.max_bytes):
        counts.update(tok(t, add_special_tokens=False)["input_ids"])
    keep = {i for i, _ in counts.most_common(a.k)}
    keep |= set(tok.all_special_ids)
    if tok.eos_token_id is not None:
        keep.add(tok.eos_token_id)
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    total = sum(counts.values())
    covered = sum(c for i, c in counts.items() if i in keep)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": ids}, str(Path(a.out) / "draft_vocab.safetensors"))
    print(f"{len(ids)} tokens cover {covered / total:.4f} of {total} counted tokens -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
