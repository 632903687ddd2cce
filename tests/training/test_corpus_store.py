"""The corpus' arrays on disk: parts of bounded size that load back to the same sequences."""

import random

import numpy as np
import pytest

from ddserve.errors import ConfigError
from ddserve.training.corpus_store import (
    Corpus,
    load_parts,
    part_paths,
    token_dtype,
    write_parts,
)


def make_corpus(n_prompts=60, vocab=49152, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n_prompts)]
    sources = [rng.choice(["self_chat", "humaneval", "raw_code"]) for _ in prompts]
    answers = [
        (p, [rng.randrange(vocab) for _ in range(rng.randint(1, 200))], t)
        for p in range(0, n_prompts, 2)  # odd prompts unanswered
        for t in (0.0, 1.0)
    ]
    return Corpus.build(prompts, sources, answers, token_dtype(vocab), {"model": "m"}), prompts


def test_parts_are_bounded_and_load_back_to_the_same_sequences(tmp_path):
    corpus, prompts = make_corpus()
    paths = write_parts(corpus, tmp_path, max_bytes=6_000)
    assert len(paths) >= 3 and part_paths(tmp_path) == paths
    assert all(p.stat().st_size <= 6_000 for p in paths)
    back = load_parts(tmp_path)
    assert len(back) == len(corpus) == 60 and back.meta == {"model": "m"}
    for i in range(len(corpus)):
        (a, pa), (b, pb) = corpus.sequence(i), back.sequence(i)
        assert np.array_equal(a, b) and pa == pb
        assert corpus.source(i) == back.source(i)
        assert corpus.answer_temperature[i] == back.answer_temperature[i]
    seq, plen = corpus.sequence(3)  # answer 3: prompt 2 at T=1
    assert seq[:plen].tolist() == prompts[2] and corpus.answer_temperature[3] == 1.0
    assert back.indices(["humaneval"], temperature=0.0) == corpus.indices(["humaneval"], 0.0)


def test_a_prompt_answered_twice_is_stored_once():
    corpus, prompts = make_corpus()
    assert len(corpus.prompt_source) == 30  # answered prompts only
    assert len(corpus.prompt_tokens) == sum(len(p) for p in prompts[::2])


def test_tokens_are_two_bytes_when_the_vocabulary_allows(tmp_path):
    small, _ = make_corpus(vocab=49152)
    assert small.answer_tokens.dtype == np.uint16
    wide, _ = make_corpus(vocab=100_000, seed=1)
    assert wide.answer_tokens.dtype == np.uint32 and wide.answer_tokens.max() >= 1 << 16
    wide.save(tmp_path / "w.npz")
    assert np.array_equal(Corpus.load(tmp_path / "w.npz").answer_tokens, wide.answer_tokens)


def test_missing_parts_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="run the corpus stage first"):
        load_parts(tmp_path)
