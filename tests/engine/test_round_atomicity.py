"""A request that fails inside a batched round fails alone: every other request of that round
gets its tokens exactly once (its output equals its output alone), for the engine the runner
builds. And no sampling value a user can send makes sampling blow up."""

import asyncio
from dataclasses import dataclass

import pytest
import torch

from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SampleGroup, SamplingParams, sample_rows, target_tokens
from ddserve.errors import EngineError

INNOCENT = [[1, 5, 6, 7, 8, 5, 6, 7], [1, 300, 301, 302, 300, 301], [1, 42], [1, 9, 9, 9, 9]]


@dataclass(frozen=True)
class Unsampleable(SamplingParams):
    """Claims to sample at temperature 0: logits / 0 is inf/nan, so its rows of the round's
    batched draw have no finite distribution, found after the shared verify (what
    temperature=1e-40 did before the floor)."""

    @property
    def greedy(self) -> bool:
        return False


def greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def collect(runner: EngineRunner, prompt: list[int], sampling: SamplingParams):
    out = []
    try:
        async for step in runner.generate(prompt, sampling):
            out += step.token_ids
    except EngineError as exc:
        return out, exc
    return out, None


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=8,
        drafter={"kind": "ngram"},
        params={"budget": 4, "topk": 2},
    )
    r = EngineRunner(cfg)
    r.start()
    yield r
    r.shutdown()


def alone(runner):
    async def main():
        return [(await collect(runner, p, greedy()))[0] for p in INNOCENT]

    return asyncio.run(main())


def test_a_request_failing_in_a_batched_round_fails_alone(runner, caplog):
    solo = alone(runner)
    caplog.set_level("WARNING", logger="ddserve.engine.rounds")

    async def main():
        innocent = [collect(runner, p, greedy()) for p in INNOCENT]
        poisoned = [collect(runner, p, Unsampleable(max_tokens=40)) for p in INNOCENT[:2]]
        return await asyncio.gather(*innocent, *poisoned)

    results = asyncio.run(main())
    together = results[: len(INNOCENT)]
    assert [err for _, err in together] == [None] * len(INNOCENT)
    assert [out for out, _ in together] == solo  # token for token, none lost or repeated
    assert all(len(out) == 40 for out in solo)
    for out, err in results[len(INNOCENT) :]:
        assert isinstance(err, EngineError) and out == []
    # the round itself did not fail: the poisoned requests failed alone inside it (their
    # sampled rows flagged), not through the runner's one-by-one retry of a failed round
    assert "batched round failed" not in caplog.text


def test_a_vanishing_temperature_decodes_greedily_in_a_batch(runner):
    """temperature=1e-40 used to overflow logits / T into inf/nan inside the round."""
    solo = alone(runner)

    async def main():
        tiny_t = SamplingParams(temperature=1e-40, max_tokens=40, ignore_eos=True, seed=1)
        return await asyncio.gather(
            *(collect(runner, p, greedy()) for p in INNOCENT), collect(runner, [1, 42], tiny_t)
        )

    results = asyncio.run(main())
    assert [err for _, err in results] == [None] * len(results)
    assert [out for out, _ in results] == [*solo, solo[2]]


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1e-40, 1.0, 0), (0.0, 1.0, 0), (-1.0, 1.0, 0), (float("nan"), 1.0, 0), (1e-5, 1.0, 0)]
    + [(float("inf"), 1.0, 0), (1.0, 0.0, 0), (1.0, -1.0, 0), (1.0, 1.0, -3), (0.7, 1e-9, 1)],
)
def test_no_sampling_value_makes_sampling_fail(temperature, top_p, top_k):
    """Neither the reference's sampler (`target_tokens`) nor the engine's batched one
    (`sample_rows`, which never sees greedy requests) fails or flags a value a user can send."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 30
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    gen = torch.Generator().manual_seed(0)
    toks = target_tokens(logits, sp, gen)
    assert toks.shape == (5,) and bool(((toks >= 0) & (toks < 50)).all())
    if sp.greedy:
        assert toks.tolist() == logits.argmax(-1).tolist()
    else:
        _, toks, ok = sample_rows(logits, [SampleGroup(0, 5, sp, None, gen)])
        assert bool(ok.all()) and bool(((toks >= 0) & (toks < 50)).all())


def test_a_chunk_failing_beside_the_step_fails_its_own_requests_only():
    """overlap_prefill: a joining prompt's chunk runs beside the running requests' step and
    is waited for after it. A device error surfacing at that wait (here raised by the join:
    on a CPU nothing overlaps) ends the requests the chunk was for, with an error; the running
    request gets every token it gets alone, and the worker keeps serving."""
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=4,
        overlap_prefill="on",
        drafter={"kind": "none"},
        params={"budget": 0},
    )
    r = EngineRunner(cfg)
    r.start()
    try:
        running = [1, 5, 6, 7, 8]
        solo = asyncio.run(collect(r, running, greedy(200)))[0]
        engine, launched = r.engine, []
        prefill, join = engine.prefill_batch, engine.join_prefill

        def prefill_batch(seqs, budget=None, overlap=False):
            launched.append(overlap)
            return prefill(seqs, budget, overlap=overlap)

        def join_prefill():
            if launched and launched[-1]:  # the chunk ran beside a step: it "failed"
                launched.clear()
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return join()

        engine.prefill_batch, engine.join_prefill = prefill_batch, join_prefill

        async def main():
            out, started = [], asyncio.Event()

            async def first():
                async for step in r.generate(running, greedy(200)):
                    out.extend(step.token_ids)
                    started.set()
                return out, None

            task = asyncio.create_task(first())
            await started.wait()  # it decodes when the newcomer joins
            late = await asyncio.wait_for(collect(r, [1, 42, 43, 44], greedy(8)), 60)
            return await asyncio.wait_for(task, 60), late

        (out, err), (late_out, late_err) = asyncio.run(main())
        assert err is None and out == solo
        assert isinstance(late_err, EngineError) and "illegal memory access" in str(late_err)
        assert late_out == []
        engine.prefill_batch, engine.join_prefill = prefill, join
        again, err = asyncio.run(asyncio.wait_for(collect(r, [1, 42, 43, 44], greedy(8)), 60))
        assert err is None and len(again) == 8  # still serving
    finally:
        r.shutdown()
