"""Long texts tokenized in parallel pieces, with exactly the ids of one encode.

A 7,200-token prompt took ~18-27 ms to encode on one core of a 2-core CPU: most of a long
prompt's time to first token besides the prefill. Byte-level BPE tokenizers (GPT-2's and
SmolLM2's, Llama 3's, Qwen's) first cut the text into pre-tokens with a regex, then merge
within each pre-token only; so a text cut where the regex always cuts encodes, piece by piece,
into the same ids, and the pieces can go to the Rust tokenizer's thread pool at once
(`encode_batch_fast` where the tokenizers package has it: the same ids without the offsets,
30% less time than `encode_batch` for a 7,200-token prompt here; both leave the GIL).

Where the cut goes: at a space whose previous character is not whitespace. No pre-token of
these regexes holds a non-whitespace character followed by a space (letters, digits and
punctuation runs stop before a space; whitespace runs hold no other character), so a
pre-token ends there, and the next one starts at the space with the same text ahead of it in
both cases (the only look-around, `\\s+(?!\\S)`, looks ahead). The first piece starts where
the text does; by induction every piece's pre-tokens are the whole text's.

Only tokenizers whose every stage is known to keep this are split: no normalizer or NFC (a
space composes with nothing; a Sequence of those, as transformers 5.17 builds it), the
ByteLevel pre-tokenizer with its GPT-2 regex or a Split by one of the known patterns before a
regex-free ByteLevel, a BPE model without dropout (byte fallback acts within a pre-token), and
added tokens that hold no whitespace and strip none (they are matched before the regex, and a
cut never falls inside one). Any other tokenizer, or a text under two pieces' length, is
encoded whole.
"""

from __future__ import annotations

import json
import os
import re
import weakref

# characters per piece at least (~330-500 tokens): a 7,200-token synthetic prompt (44k
# characters) goes to 16 threads as 16 pieces, where 4,096 made 10; shorter texts gain
# nothing from threads (bench/tokenizer_probe.py --piece-chars)
PIECE_CHARS = 2048

# Split patterns whose pre-tokens never hold a non-whitespace character followed by a space
# (the module docstring's argument, checked for each): Llama 3's / GPT-4's, and Qwen 2's
KNOWN_SPLITS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)

_splittable: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _byte_level(p: dict, use_regex: bool) -> bool:
    return (
        p.get("type") == "ByteLevel"
        and not p.get("add_prefix_space")
        and bool(p.get("use_regex", True)) == use_regex
    )


def _pre_tokenizer_ok(p: dict | None) -> bool:
    if not p:
        return False
    if _byte_level(p, True):
        return True
    if p.get("type") != "Sequence" or len(p.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = p["pretokenizers"]
    return (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in KNOWN_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and _byte_level(byte_level, False)
    )


def _normalizer_ok(n: dict | None) -> bool:
    """None, NFC, or a Sequence of those (transformers 5.17 builds an empty Sequence)."""
    if n is None or n.get("type") == "NFC":
        return True
    return n.get("type") == "Sequence" and all(map(_normalizer_ok, n.get("normalizers", [])))


def splittable(backend) -> bool:
    """Whether a `tokenizers.Tokenizer` encodes a text cut at our points into the same ids."""
    try:
        d = json.loads(backend.to_str())
    except Exception:  # not a Rust tokenizer we can read
        return False
    model = d.get("model") or {}
    return (
        _normalizer_ok(d.get("normalizer"))
        and _pre_tokenizer_ok(d.get("pre_tokenizer"))
        and model.get("type") == "BPE"
        and not model.get("dropout")
        and all(
            not (a.get("lstrip") or a.get("rstrip"))
            and not any(ch.isspace() for ch in a.get("content", " "))
            for a in d.get("added_tokens", [])
        )
    )


_CUT = re.compile(r"(?<!\s) ")  # a space after a non-whitespace character (Python's \s
# is str.isspace, a superset of the tokenizers' regex \s: it only forgoes a few cuts)


def cut_points(text: str, pieces: int) -> list[int]:
    """Up to pieces - 1 positions, increasing, each a space after a non-whitespace character,
    the first at or after len/pieces, each at least PIECE_CHARS after the one before."""
    cuts, at = [], 0
    step = max(PIECE_CHARS, len(text) // pieces)
    while len(cuts) < pieces - 1:
        m = _CUT.search(text, at + step)
        if m is None or len(text) - m.start() < PIECE_CHARS:
            break
        at = m.start()
        cuts.append(at)
    return cuts


def cpu_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ready(tokenizer) -> bool:
    """Whether `tokenizer` encodes long texts in pieces (computed once per tokenizer and
    vocabulary size, ~0.2 s for a 49k vocabulary: call it at load, not on a request)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    size = backend.get_vocab_size(with_added_tokens=True)  # added tokens change the answer
    known = _splittable.get(tokenizer)
    if known is None or known[1] != size:
        known = _splittable[tokenizer] = (splittable(backend), size)
    return known[0]


def parallel(tokenizer, threads: int | None = None) -> int:
    """The pieces a long text is encoded in (at most): this host's threads (or `threads`)
    where the tokenizer splits exactly and there are two or more; 0 = encoded whole."""
    threads = threads or cpu_threads()
    return threads if threads >= 2 and ready(tokenizer) else 0


def encode_pieces(tokenizer, text: str, threads: int | None = None) -> list[int] | None:
    """The ids of `tokenizer.encode(text, add_special_tokens=False)`, encoded as parallel
    pieces; None where that cannot be done exactly or would not pay (encode it whole)."""
    if len(text) < 2 * PIECE_CHARS:
        return None
    threads = parallel(tokenizer, threads)
    if not threads:
        return None
    backend = tokenizer.backend_tokenizer
    # the wrapper sets these on the backend per call; a bare backend call reads what is left
    if (
        getattr(tokenizer, "split_special_tokens", False)
        or getattr(backend, "encode_special_tokens", False)
        or backend.truncation is not None
        or backend.padding is not None
    ):
        return None
    cuts = cut_points(text, threads)
    if not cuts:
        return None
    bounds = [0, *cuts, len(text)]
    parts = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out: list[int] = []
    batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    for enc in batch(parts, add_special_tokens=False):
        out.extend(enc.ids)
    return out
