"""The drafter's vocabulary subset: the most frequent target tokens, so drafting computes the
LM head over K rows instead of the whole vocabulary (on a 2-core CPU the full 49,152-row head
costs ~10 ms per draft, a fifth of a target step). Verification is untouched, so output stays
lossless; a target token outside the subset can only be the bonus token, never a draft.

    python -m ddserve.training.draft_vocab --model smollm2-135m --k 16384 --corpus WORK --out DIR

Frequencies: with --corpus, the answer tokens of the drafter's training corpus (the corpus
parts of those work directories: what the target itself writes, which is what the drafter
proposes); without, the training prompts plus the Python standard library's own source
(code and English prose, both on this machine; such a set covered 93.4% of the target's
held-out greedy answer tokens where 16,384 of its own answers' covered 98.4%: bench/NOTES.md).
EOS and special tokens are always kept. Writes DIR/draft_vocab.safetensors (token_ids,
int64, ascending).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ddserve.engine.weights import load_model, load_tokenizer
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


def keep_ids(counts: np.ndarray, k: int, tok, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `k` most counted token ids (counts [V] per id) plus the tokenizer's special ones
    and EOS (those the model has: ids below `vocab_size`), ascending; and the share of the
    counted tokens they cover."""
    order = np.argsort(-counts, kind="stable")[:k]
    keep = {int(i) for i in order if counts[i] > 0}
    keep |= set(tok.all_special_ids)
    if tok.eos_token_id is not None:
        keep.add(tok.eos_token_id)
    ids = torch.tensor(sorted(i for i in keep if 0 <= i < vocab_size), dtype=torch.long)
    total = int(counts.sum())
    covered = int(counts[ids[ids < len(counts)].numpy()].sum())
    return ids, covered / max(total, 1)


def answer_counts(corpus, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in a corpus' answers."""
    return np.bincount(np.asarray(corpus.answer_tokens, dtype=np.int64), minlength=vocab_size)


def save_vocab(ids: torch.Tensor, directory: Path) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": ids}, str(Path(directory) / "draft_vocab.safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--max-bytes", type=int, default=12_000_000)
    ap.add_argument("--corpus", help="count the answers of these work dirs' corpus parts (a,b)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.k < 1:
        raise SystemExit("draft_vocab: --k must be at least 1")
    from ddserve.errors import ConfigError

    try:
        tok = load_tokenizer(a.model)
        size = load_model(a.model, with_tokenizer=False).model.cfg.vocab_size
    except (ConfigError, OSError, ValueError) as exc:
        raise SystemExit(f"draft_vocab: --model {a.model}: {exc}") from None
    if a.corpus:
        from ddserve.training.corpus_store import load_parts

        counts = np.zeros(size, dtype=np.int64)
        for work in a.corpus.split(","):
            try:
                c = answer_counts(load_parts(Path(work)), size)
            except ConfigError as exc:
                raise SystemExit(f"draft_vocab: {exc}") from None
            counts += c[:size]  # (answers hold the target's own ids: all below it)
    else:
        counter = collections.Counter()
        for t in texts(a.max_bytes):
            counter.update(tok(t, add_special_tokens=False)["input_ids"])
        counts = np.zeros(size, dtype=np.int64)
        for i, n in counter.items():
            if i < size:
                counts[i] = n
    ids, coverage = keep_ids(counts, a.k, tok, size)
    save_vocab(ids, Path(a.out))
    print(
        f"{len(ids)} tokens cover {coverage:.4f} of {int(counts.sum())} counted tokens -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
