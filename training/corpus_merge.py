"""Earlier runs' corpora beside this run's (`--corpus-from`, ddserve.training.dflash): their
answers joined to this run's, less those to this run's held-out prompts and the repeated
greedy answers that fixed sources give in every run."""

from __future__ import annotations

from pathlib import Path

from ddserve.training.corpus import log_json
from ddserve.training.corpus_store import Corpus, load_parts
from ddserve.training.prompts import normalized


def with_earlier(corpus: Corpus, dirs: list[str], work: Path, tokenizer) -> Corpus:
    """This run's corpus and the corpus parts in the work directories of earlier runs
    (--corpus-from) of the same target, less every answer of theirs to one of this run's
    held-out prompts (compared as texts are within a run: decoded, `normalized`; runs of
    another --seed held other prompts out) and every greedy answer to a prompt already
    answered greedily (the fixed sources come back in every run: the same answer twice)."""

    def key(c: Corpus, p: int) -> tuple[int, ...]:
        return tuple(c.prompt(p).tolist())

    def text(c: Corpus, p: int) -> str:
        return normalized(tokenizer.decode(c.prompt(p).tolist()))

    held = Corpus.load(work / "heldout.npz")
    held_texts = {text(held, p) for p in range(len(held.prompt_source))}
    greedy = {key(corpus, int(corpus.answer_prompt[i])) for i in corpus.indices(temperature=0.0)}
    parts, used = [corpus], {Path(work).resolve()}
    for d in dirs:
        if (path := Path(d).resolve()) in used:
            continue  # the same corpus twice
        used.add(path)
        earlier = load_parts(Path(d))
        if earlier.meta.get("model") != corpus.meta.get("model"):
            raise SystemExit(
                f"--corpus-from {d}: its corpus is of {earlier.meta.get('model')!r}, "
                f"this run's of {corpus.meta.get('model')!r}"
            )
        held_out = {p for p in range(len(earlier.prompt_source)) if text(earlier, p) in held_texts}
        keep, dropped, dup = [], 0, 0
        for i in range(len(earlier)):
            p = int(earlier.answer_prompt[i])
            if p in held_out:
                dropped += 1
                continue
            if earlier.answer_temperature[i] == 0.0:
                if (k := key(earlier, p)) in greedy:
                    dup += 1
                    continue
                greedy.add(k)
            keep.append(i)
        log_json(
            stage="corpus",
            earlier=str(d),
            answers=len(earlier),
            held_out=dropped,
            greedy_repeats=dup,
        )
        parts.append(earlier.select(keep) if len(keep) < len(earlier) else earlier)
    merged = Corpus.concat(parts)
    merged.meta = {**corpus.meta, **merged.summary(), "corpus_from": list(dirs)}
    return merged
