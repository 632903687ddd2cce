"""Several decoding steps a round (ddserve.engine.static_steps, `--num-scheduler-steps`): the
same tokens as one-step rounds -- greedy token for token the reference's, alone and in
batches with late joiners, stopping inside a round; seeded samples (with filters and a
logit bias) draw for draw those of one-step rounds -- requests with log-probs fall back to
one step, a step with non-finite logits ends its request with nothing committed, and the
runner steps once a round while prompts wait. The CUDA test (graphs, fp32) runs on a GPU
machine (the device tool), not in CI."""

import asyncio
import time

import pytest
import torch

from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.sequence import tokens_before
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import random_llama, tiny_config
from ddserve.errors import EngineError
from tests.engine.reference import ReferenceEngine
from tests.engine.test_batching import PROMPTS, run_lockstep

LENGTHS = [30, 12, 25, 40, 5]
AR = LiveParams(budget=0, topk=1)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def tiny_on(device: str):
    return random_llama(tiny_config(vocab_size=512), seed=3).to(device)


def engine(model, steps: int, eos=(), graphs=False) -> StaticEngine:
    return StaticEngine(
        model, NoDrafter(), 6, eos, slots=8, max_context=256, graphs=graphs, scheduler_steps=steps
    )


def check_greedy(model, graphs: bool):
    ref = ReferenceEngine(model, NoDrafter(), 6, ())
    alone = [
        ref.generate(p, SamplingParams(max_tokens=n), AR)
        for p, n in zip(PROMPTS, LENGTHS, strict=True)
    ]
    for steps in (2, 3, 8):
        eng = engine(model, steps, graphs=graphs)
        nexts, forward_next = [], eng.target.forward_next
        eng.target.forward_next = lambda *a, n=nexts, f=forward_next: (n.append(1), f(*a))[1]
        mine = [
            eng.generate(p, SamplingParams(max_tokens=n), AR)
            for p, n in zip(PROMPTS, LENGTHS, strict=True)
        ]
        assert [s.output for s in mine] == [s.output for s in alone], steps
        for s in mine:  # plain decoding: one token a forward, whatever a round holds
            assert s.stats.accept_lengths == [1] * len(s.output) and s.stats.tau == 1.0
        assert nexts  # several steps a round did run
        together = run_lockstep(
            eng, PROMPTS, [SamplingParams(max_tokens=n) for n in LENGTHS], AR, join_late={2, 4}
        )
        assert together == [s.output for s in alone], steps
        assert eng.free_slots == 8


def test_greedy_steps_equal_the_reference_cpu():
    check_greedy(tiny_on("cpu"), graphs=False)


@cuda
def test_greedy_steps_equal_the_reference_cuda_graphs_fp32():
    check_greedy(tiny_on("cuda"), graphs=True)


def test_a_stop_token_inside_a_round_ends_the_answer_there():
    """EOS at the 4th token of a 5-step round: the answer is the reference's, cut there; the
    next request in the same slot decodes as if the round had stopped at the EOS."""
    model = tiny_on("cpu")
    base = ReferenceEngine(model, NoDrafter(), 6, ()).generate(
        PROMPTS[0], SamplingParams(max_tokens=12), AR
    )
    eos = base.output[3]
    want = ReferenceEngine(model, NoDrafter(), 6, (eos,)).generate(
        PROMPTS[0], SamplingParams(max_tokens=12), AR
    )
    eng = engine(model, 5, eos=(eos,))
    seq = eng.generate(PROMPTS[0], SamplingParams(max_tokens=12), AR)
    assert seq.output == want.output and seq.finish_reason == "stop"
    assert seq.output[-1] == eos and len(seq.output) <= 4
    again = eng.generate(PROMPTS[1], SamplingParams(max_tokens=9), AR)
    plain = engine(model, 1, eos=(eos,)).generate(PROMPTS[1], SamplingParams(max_tokens=9), AR)
    assert again.output == plain.output


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_seeded_samples_draw_as_one_step_rounds_do(device):
    """Sampled requests (temperature, top-k, top-p, a logit bias, seeds) beside greedy ones:
    every token as in one-step rounds, the generator advanced once a step."""
    model = tiny_on(device)
    bias = ((5, 3.0), (9, -100.0))
    sampling = [
        SamplingParams(max_tokens=14, temperature=1.0, seed=1),
        SamplingParams(max_tokens=9),
        SamplingParams(max_tokens=11, temperature=0.7, top_k=20, top_p=0.9, seed=2),
        SamplingParams(max_tokens=13, temperature=1.3, seed=3, logit_bias=bias),
        SamplingParams(max_tokens=10, logit_bias=bias),
    ]
    outs = []
    for steps in (1, 4):
        eng = engine(model, steps, graphs=device == "cuda")
        outs.append(run_lockstep(eng, PROMPTS, sampling, AR, join_late={2}))
    assert outs[0] == outs[1]
    assert 9 not in outs[1][3] and 9 not in outs[1][4]  # the bias holds in every step


def test_requests_with_logprobs_take_one_step_rounds():
    model = tiny_on("cpu")
    eng = engine(model, 4)
    seq = eng.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=2), AR)
    plain = engine(model, 1).generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=2), AR)
    assert seq.output == plain.output and len(seq.logprobs) == 6
    assert eng.timing["rounds"] == 6


def test_non_finite_logits_end_the_request_with_nothing_committed():
    model = tiny_on("cpu")
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    eng = engine(model, 4)
    seq = eng.new_sequence(PROMPTS[0], SamplingParams(max_tokens=8))
    eng.prefill(seq)
    length = seq.cache.length
    (out,) = eng.step_batch([seq], AR)
    assert isinstance(out, EngineError) and "non-finite" in str(out)
    assert seq.output == [] and seq.cache.length == length and seq.finish_reason == "error"


def test_a_non_finite_step_after_others_ends_the_request_after_their_tokens():
    """A round of four steps whose third has non-finite logits in one request's row: that
    request ends with the first two steps' tokens committed (the reference's), which the
    error carries for delivery before it; the request beside it gets its four."""
    model = tiny_on("cpu")
    eng = engine(model, 4)
    sp = SamplingParams(max_tokens=20)
    seqs = [eng.new_sequence(p, sp) for p in PROMPTS[:2]]
    for seq in seqs:
        eng.prefill(seq)
    forward_next, calls, slot = eng.target.forward_next, [], seqs[0].cache.slot

    def poisoned(*a):
        logits, top, taps = forward_next(*a)
        calls.append(1)
        if len(calls) == 2:  # the round's third step (the first is a full forward)
            top = top.clone()
            top[1, slot] = 0
        return logits, top, taps

    eng.target.forward_next = poisoned
    bad, good = eng.step_batch(seqs, AR)
    assert isinstance(bad, EngineError) and "non-finite" in str(bad)
    assert tokens_before(bad) == seqs[0].output and len(seqs[0].output) == 2
    assert seqs[0].finish_reason == "error" and len(good) == 4
    ref = ReferenceEngine(model, NoDrafter(), 6, ())
    want = [ref.generate(p, sp, AR).output for p in PROMPTS[:2]]
    assert seqs[0].output == want[0][:2] and good == want[1][:4]


def test_the_runner_delivers_a_failed_rounds_earlier_tokens_before_its_error(monkeypatch):
    """Through the runner (four steps a trip): a trip whose third step goes non-finite ends
    the request with an error after the tokens before it, as one-step rounds stream them."""
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=2,
        num_scheduler_steps=4,
        drafter={"kind": "none"},
    )
    runner = EngineRunner(cfg)
    runner.start()
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    async def collect():
        out = []
        try:
            async for step in runner.generate([1, 5, 9], sp):
                out.append(step.token_ids)
        except EngineError as exc:
            return out, exc
        return out, None

    try:
        alone, err = asyncio.run(collect())
        assert err is None
        forward_next, calls = runner.engine.target.forward_next, []

        def poisoned(*a):
            logits, top, taps = forward_next(*a)
            calls.append(1)
            if len(calls) == 2:  # the second trip's third step: its first trip takes one
                top = top.clone()
                top[1] = 0
            return logits, top, taps

        monkeypatch.setattr(runner.engine.target, "forward_next", poisoned)
        chunks, err = asyncio.run(collect())
    finally:
        runner.shutdown()
    assert isinstance(err, EngineError) and "non-finite" in str(err)
    assert chunks == [alone[0], alone[1][:2]]  # the first token, then the trip's two


async def answer(runner, prompt, n, firsts, running=None) -> list[int]:
    """A request's `n` tokens through `runner` (ignore_eos): its first chunk's length goes
    into `firsts`; `running` (an event) is set at each chunk."""
    out = []
    async for step in runner.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        if not out:
            firsts.append(len(step.token_ids))
        out += step.token_ids
        if running is not None:
            running.set()
    return out


def test_runner_steps_once_a_round_while_prompts_wait(monkeypatch):
    """Through the runner (num_scheduler_steps=4): concurrent requests get their answers alone;
    a round with prompts joining asks for one step, a round without them for four; every
    request's first token comes after one step; the prefill pacer is told one step's time."""
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=4,
        num_scheduler_steps=4,
        drafter={"kind": "none"},
        overlap_prefill="on",  # prompts that end beside a step are stepped a round later
    )
    runner = EngineRunner(cfg)
    asked = []
    runner.start()
    try:
        step_batch = runner.engine.step_batch

        rounds, told = [], []

        def spy(seqs, params, steps=None):
            asked.append(steps)
            t0 = time.perf_counter()
            try:
                return step_batch(seqs, params, steps)
            finally:
                rounds.append((runner.engine.round_steps, time.perf_counter() - t0))

        stepped = runner.pacer.stepped
        monkeypatch.setattr(runner.engine, "step_batch", spy)
        monkeypatch.setattr(runner.pacer, "stepped", lambda s: (told.append(s), stepped(s))[1])
        firsts = []

        def one(p, n=10, running=None):
            return answer(runner, p, n, firsts, running)

        async def main():
            together = await asyncio.gather(*(one([1, 5 + i, 9]) for i in range(6)))
            alone = [await one([1, 5 + i, 9]) for i in range(6)]
            # one joining a running request: its prompt goes in beside that one's step
            # (overlap), and it is stepped from the next round, with no prompt joining
            running = asyncio.Event()
            long = asyncio.create_task(one([2, 3, 4], 200, running))
            await running.wait()
            late = await one([1, 5, 9])
            await long
            return together, alone + [late]

        together, alone = asyncio.run(main())
        alone, late = alone[:6], alone[6]
    finally:
        runner.shutdown()
    assert together == alone and all(len(o) == 10 for o in together) and late == alone[0]
    assert 1 in asked and 4 in asked
    assert firsts == [1] * 14  # a first token after one step, never four
    four = [t for n, t in rounds if n == 4]
    assert four and max(told) < 0.6 * max(four)  # a step's time, not a 4-step round's


def late_joiner(monkeypatch, share: float, beside: bool = False):
    """Through a runner (four steps a trip, --first-token-share `share`, rounds.
    JOIN_BESIDE_TRIP `beside`): a request alone, then the same one joining a long decoding
    request. Returns (its answer alone, joining, the three requests' first chunks' lengths,
    the steps each step_batch call was asked for)."""
    from ddserve.engine import rounds

    monkeypatch.setattr(rounds, "JOIN_BESIDE_TRIP", beside)
    cfg = EngineConfig(
        first_token_share=share,
        model="tiny-random",
        device="cpu",
        max_batch=4,
        num_scheduler_steps=4,
        drafter={"kind": "none"},
        overlap_prefill="on",
    )
    runner = EngineRunner(cfg)
    runner.start()
    firsts, asked, step_batch = [], [], runner.engine.step_batch
    monkeypatch.setattr(
        runner.engine, "step_batch", lambda s, p, n=None: (asked.append(n), step_batch(s, p, n))[1]
    )

    def one(p, n=10, running=None):
        return answer(runner, p, n, firsts, running)

    async def main():
        alone = await one([1, 5, 9])
        running = asyncio.Event()
        long = asyncio.create_task(one([2, 3, 4], 400, running))
        await running.wait()
        late = await one([1, 5, 9])
        await long
        return alone, late

    try:
        alone, late = asyncio.run(main())
    finally:
        runner.shutdown()
    return alone, late, firsts, asked


def test_a_newcomer_beside_decoding_requests_takes_their_steps_under_first_token_share(
    monkeypatch,
):
    """--first-token-share 0.5: a request joining one that decodes is half the round's
    requests, not more, so the trip keeps its four steps and the newcomer's first token comes
    with three more (by default one step: test above); its answer is still its answer alone."""
    alone, late, firsts, asked = late_joiner(monkeypatch, 0.5)
    assert late == alone and len(late) == 10
    # alone: all of the round's requests are new (one step); the long one's first: alone too
    assert firsts == [1, 1, 4]
    assert asked.count(1) == 3  # and the round the joining prompt went in


def test_a_prompt_joins_beside_a_trip_under_the_experiment_switch(monkeypatch):
    """rounds.JOIN_BESIDE_TRIP with --first-token-share 0.5: a prompt joining a decoding
    request is half of the round's requests, so neither the round its prompt goes in nor its
    first token's takes one step (by default both do); its answer is its answer alone."""
    alone, late, firsts, asked = late_joiner(monkeypatch, 0.5, beside=True)
    assert late == alone and len(late) == 10 and firsts == [1, 1, 4]
    assert asked.count(1) == 2  # the first tokens of the two requests that came alone
