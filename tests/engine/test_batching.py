"""Batched verification: several requests share one target forward per round (packed trees,
each under its own mask over its own cache) and requests join and leave between rounds.
Batched greedy output == per-request greedy output; batched sampling still follows the
target distribution exactly."""

import numpy as np
import pytest
import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import ModelDrafter, NGramDrafter, NoDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.weights import random_llama, tiny_config
from tests.engine.reference import one_engine
from tests.engine.test_lossless import V, chi2_pvalue, exact_pairs, random_dflash

PROMPTS = [
    [1, 5, 6, 7, 8, 5, 6, 7],
    [1, 300, 301, 302, 303, 304, 300, 301, 302],
    [1, 42],
    [1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
    [1, 77, 78],
]


@pytest.fixture(scope="module")
def tiny():
    return random_llama(tiny_config(vocab_size=512), seed=3)


def test_packed_forward_equals_separate_forwards(tiny):
    caches = [tiny.new_cache() for _ in PROMPTS]
    toks = [torch.tensor(p) for p in PROMPTS]
    pos = [torch.arange(len(p)) for p in PROMPTS]
    batched, hidden = tiny.forward_batch(toks, pos, caches, [None] * len(PROMPTS), capture=(0,))
    for p, lg, h in zip(PROMPTS, batched, hidden, strict=True):
        ref, ref_h = tiny(torch.tensor(p), torch.arange(len(p)), tiny.new_cache(), capture=(0,))
        # different matmul shapes round differently: equal to float32 rounding
        assert torch.allclose(lg, ref, atol=1e-4) and torch.allclose(h, ref_h, atol=1e-4)


def run_lockstep(eng, prompts, sampling, params, join_late=()):
    """All sequences advance together with step_batch; those in `join_late` join after two
    rounds; finished ones leave. Returns outputs in prompt order."""
    seqs = [eng.new_sequence(p, s) for p, s in zip(prompts, sampling, strict=True)]
    joined, rounds = set(), 0
    while True:
        for i, seq in enumerate(seqs):
            if i not in joined and (i not in join_late or rounds >= 2):
                eng.prefill(seq)
                joined.add(i)
        active = [s for i, s in enumerate(seqs) if i in joined and not s.finished]
        if not active and len(joined) == len(seqs):
            break
        eng.step_batch(active, params)
        rounds += 1
    for seq in seqs:
        eng.release(seq)
    return [s.output for s in seqs]


@pytest.mark.parametrize("budget,topk", [(0, 1), (6, 2), (16, 4)])
def test_batched_greedy_equals_per_request(tiny, budget, topk):
    drafters = {
        "none": NoDrafter(),
        "ngram": NGramDrafter(512),
        "draft-model-self": ModelDrafter(tiny),
        "dflash-untrained": DFlashDrafter(random_dflash(tiny), tiny),
    }
    params = LiveParams(budget=budget, topk=topk)
    lengths = [30, 12, 25, 40, 5]  # different lengths: sequences leave at different rounds
    for name, drafter in drafters.items():
        eng = one_engine(tiny, drafter, 6)
        alone = [
            eng.generate(p, SamplingParams(max_tokens=n), params).output
            for p, n in zip(PROMPTS, lengths, strict=True)
        ]
        together = run_lockstep(
            eng, PROMPTS, [SamplingParams(max_tokens=n) for n in lengths], params, join_late={2, 4}
        )
        assert together == alone, name


def check_batched_sampling(make_engine, n: int = 2400, tv: float = 0.05) -> None:
    """Batches of 8 requests sampling 2 tokens (T=1) through `make_engine(target, drafter)`:
    the pair frequencies must match exact enumeration of the target's distribution."""
    cfg = tiny_config(vocab_size=V)
    target, draft = random_llama(cfg, seed=11), random_llama(cfg, seed=12)
    probs = exact_pairs(target, [1, 2, 3], 1.0, 1.0, 0)
    eng = make_engine(target, ModelDrafter(draft))
    params = LiveParams(budget=6, topk=3)
    counts = np.zeros(V * V)
    batch = 8
    for start in range(0, n, batch):
        sampling = [
            SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=start + i)
            for i in range(batch)
        ]
        for out in run_lockstep(eng, [[1, 2, 3]] * batch, sampling, params):
            counts[out[0] * V + out[1]] += 1
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < tv


def test_batched_sampling_follows_target_distribution():
    check_batched_sampling(lambda target, drafter: one_engine(target, drafter, 3))
