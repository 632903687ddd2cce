"""The corpus as compact arrays, on disk as compressed .npz parts.

Arrays (a prompt answered at several temperatures is stored once):
  prompt_tokens       uint16 [Np]   every prompt's ids back to back (uint32 past 65,536 ids)
  prompt_offsets      int64 [P+1]   prompt p = prompt_tokens[prompt_offsets[p]:prompt_offsets[p+1]]
  prompt_source       uint8 [P]     index into `sources` (names of prompts.SOURCES)
  answer_tokens       uint16 [Na]   every answer's ids back to back
  answer_offsets      int64 [A+1]
  answer_prompt       int32 [A]     the prompt answer a continues
  answer_temperature  float32 [A]
  meta                uint8         JSON: the source names, and whatever the writer adds
Training sequence i = prompt of answer i + answer i, its prompt length that prompt's.

`write_parts` splits by answers into self-contained parts (each holds the prompts its answers
use) of at most `max_bytes` each: one part is written; if it is too large, the answers are cut
into enough equal pieces by the ratio of the sizes and each is written (and cut again) the
same way. `load_parts` concatenates them in order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddserve.errors import ConfigError


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _flat(seqs: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]) if seqs else np.zeros(0)
    return flat.astype(dtype), offsets


@dataclass
class Corpus:
    prompt_tokens: np.ndarray
    prompt_offsets: np.ndarray
    prompt_source: np.ndarray
    answer_tokens: np.ndarray
    answer_offsets: np.ndarray
    answer_prompt: np.ndarray
    answer_temperature: np.ndarray
    sources: tuple[str, ...]
    meta: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        prompt_sources: list[str],
        answers: list[tuple[int, list[int], float]],
        dtype: type,
        meta: dict | None = None,
    ) -> Corpus:
        """From prompts (ids, source name) and answers (prompt index, ids, temperature), token
        ids stored as `dtype` (`token_dtype`); prompts no answer uses are left out."""
        used = sorted({p for p, _, _ in answers})
        remap = {p: i for i, p in enumerate(used)}
        sources = tuple(sorted({prompt_sources[p] for p in used}))
        pt, po = _flat([prompts[p] for p in used], dtype)
        at, ao = _flat([a for _, a, _ in answers], dtype)
        return cls(
            pt,
            po,
            np.array([sources.index(prompt_sources[p]) for p in used], dtype=np.uint8),
            at,
            ao,
            np.array([remap[p] for p, _, _ in answers], dtype=np.int32),
            np.array([t for _, _, t in answers], dtype=np.float32),
            sources,
            dict(meta or {}),
        )

    def __len__(self) -> int:
        return len(self.answer_prompt)

    def prompt(self, p: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[p] : self.prompt_offsets[p + 1]]

    def answer(self, i: int) -> np.ndarray:
        return self.answer_tokens[self.answer_offsets[i] : self.answer_offsets[i + 1]]

    def prompt_len(self, i: int) -> int:
        """The prompt length of answer i."""
        p = int(self.answer_prompt[i])
        return int(self.prompt_offsets[p + 1] - self.prompt_offsets[p])

    def answer_len(self, i: int) -> int:
        return int(self.answer_offsets[i + 1] - self.answer_offsets[i])

    def sequence(self, i: int) -> tuple[np.ndarray, int]:
        """Training sequence i: (prompt + answer ids as int64, prompt length)."""
        p = self.prompt(int(self.answer_prompt[i]))
        return np.concatenate([p, self.answer(i)]).astype(np.int64), len(p)

    def source(self, i: int) -> str:
        return self.sources[self.prompt_source[self.answer_prompt[i]]]

    @property
    def answer_token_count(self) -> int:
        return int(self.answer_offsets[-1])

    def indices(self, sources: Iterable[str] = (), temperature: float | None = None) -> list[int]:
        """Answers whose prompt is from one of `sources` (any if empty), at `temperature`
        (any if None)."""
        want = {self.sources.index(s) for s in sources if s in self.sources}
        src = self.prompt_source[self.answer_prompt]
        ok = np.isin(src, list(want)) if sources else np.ones(len(self), dtype=bool)
        if temperature is not None:
            ok &= self.answer_temperature == temperature
        return np.flatnonzero(ok).tolist()

    def summary(self) -> dict:
        """Answers and answer tokens by source."""
        by: dict[str, list[int]] = {}
        for i in range(len(self)):
            n = by.setdefault(self.source(i), [0, 0])
            n[0] += 1
            n[1] += self.answer_len(i)
        return {
            "sequences": len(self),
            "answer_tokens": self.answer_token_count,
            "by_source": {s: {"answers": a, "tokens": t} for s, (a, t) in sorted(by.items())},
        }

    def select(self, idx: list[int]) -> Corpus:
        """The answers `idx` (in that order) and their prompts, as a corpus of its own."""
        prompts = [self.prompt(p) for p in range(len(self.prompt_source))]
        names = [self.sources[s] for s in self.prompt_source]
        answers = [
            (int(self.answer_prompt[i]), self.answer(i), float(self.answer_temperature[i]))
            for i in idx
        ]
        return Corpus.build(prompts, names, answers, self.answer_tokens.dtype.type, self.meta)

    @classmethod
    def concat(cls, parts: list[Corpus]) -> Corpus:
        prompts, names, answers = [], [], []
        for c in parts:
            base = len(prompts)
            prompts += [c.prompt(p) for p in range(len(c.prompt_source))]
            names += [c.sources[s] for s in c.prompt_source]
            answers += [
                (base + int(c.answer_prompt[i]), c.answer(i), float(c.answer_temperature[i]))
                for i in range(len(c))
            ]
        wide = any(c.answer_tokens.dtype == np.uint32 for c in parts)
        meta = parts[0].meta if parts else {}
        return cls.build(prompts, names, answers, np.uint32 if wide else np.uint16, meta)

    # -- files ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        meta = json.dumps({**self.meta, "sources": list(self.sources)}).encode()
        arrays = {k: getattr(self, k) for k in ARRAYS}
        with open(path, "wb") as f:  # a file object: numpy adds no .npz to the name
            np.savez_compressed(f, meta=np.frombuffer(meta, dtype=np.uint8), **arrays)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            arrays = {k: z[k] for k in ARRAYS}
        sources = tuple(meta.pop("sources"))
        return cls(**arrays, sources=sources, meta=meta)


ARRAYS = (
    "prompt_tokens",
    "prompt_offsets",
    "prompt_source",
    "answer_tokens",
    "answer_offsets",
    "answer_prompt",
    "answer_temperature",
)


def write_parts(
    corpus: Corpus, directory: Path, max_bytes: int, stem: str = "corpus"
) -> list[Path]:
    """`corpus` as DIRECTORY/STEM-000.npz, -001, ... each at most `max_bytes` (see the module
    docstring); written under temporary names and renamed at the end, so a directory holds
    either all parts or none."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pieces: list[Path] = []

    def write(idx: list[int]) -> None:
        tmp = directory / f".{stem}-{len(pieces):03d}.tmp"
        corpus.select(idx).save(tmp)
        size = tmp.stat().st_size
        if size <= max_bytes or len(idx) <= 1:
            pieces.append(tmp)
            return
        tmp.unlink()
        k = max(2, math.ceil(size / (0.95 * max_bytes)))
        step = math.ceil(len(idx) / k)
        for j in range(0, len(idx), step):
            write(idx[j : j + step])

    write(list(range(len(corpus))))
    for old in directory.glob(f"{stem}-*.npz"):
        old.unlink()
    out = []
    for j, tmp in enumerate(pieces):
        out.append(directory / f"{stem}-{j:03d}.npz")
        tmp.rename(out[-1])
    return out


def part_paths(directory: Path, stem: str = "corpus") -> list[Path]:
    return sorted(Path(directory).glob(f"{stem}-[0-9][0-9][0-9].npz"))


def load_parts(directory: Path, stem: str = "corpus") -> Corpus:
    paths = part_paths(directory, stem)
    if not paths:
        raise ConfigError(f"no {stem}-NNN.npz parts in {directory}: run the corpus stage first")
    parts = [Corpus.load(p) for p in paths]
    return parts[0] if len(parts) == 1 else Corpus.concat(parts)
