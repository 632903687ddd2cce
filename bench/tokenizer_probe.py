"""How this host tokenises a long prompt (issue 18: most of a long prompt's time before the
engine): the tokenizers / transformers versions, whether the bundled tokenizer splits into
parallel pieces here (ddserve.api.pieces) and into how many, and the median time of one
~N-token synthetic prompt in pieces and whole; with --piece-chars, the same in pieces of at
least each of those sizes (`pieces.PIECE_CHARS`), the ids checked equal to one encode's.

    python -m ddserve.bench.tokenizer_probe [--tokens 7200] [--piece-chars 4096,2048,1024]
"""

from __future__ import annotations

import argparse
import time


def median_ms(fn, n: int = 9) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[n // 2] * 1e3, 2)


def main() -> None:
    import tokenizers
    import transformers

    from ddserve.api import pieces
    from ddserve.bench.prompts import synthetic_set
    from ddserve.engine.weights import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=7200)
    ap.add_argument("--piece-chars", default="", help="comma-separated PIECE_CHARS to try")
    a = ap.parse_args()
    tok = load_tokenizer("smollm2-135m")
    text = synthetic_set(a.tokens, 1, "smollm2-135m")[0][0]
    print(
        "tokenizers", tokenizers.__version__, "transformers", transformers.__version__,
        "ready", pieces.ready(tok), "threads", pieces.cpu_threads(),
        "pieces", pieces.parallel(tok),
    )  # fmt: skip
    print(
        "pieces ms", median_ms(lambda: pieces.encode_pieces(tok, text)),
        "whole ms", median_ms(lambda: tok.encode(text, add_special_tokens=False)),
    )  # fmt: skip
    whole = tok.encode(text, add_special_tokens=False)
    for size in [int(x) for x in a.piece_chars.split(",") if x]:
        pieces.PIECE_CHARS = size
        same = pieces.encode_pieces(tok, text) in (None, whole)
        n = len(pieces.cut_points(text, pieces.parallel(tok) or 1)) + 1
        ms = median_ms(lambda: pieces.encode_pieces(tok, text))
        print("piece_chars", size, "pieces", n, "ms", ms, "same ids", same)


if __name__ == "__main__":
    main()
