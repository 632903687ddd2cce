"""The static engine's prompts: chunked prefill (each chunk writes its own keys and values
only, a prefill budget bounds a call, short prompts go in whole, first come first), prompts
joining running requests (admission between rounds, beside a step on a GPU), graphs of the
chunk shapes, and what a prompt's wait counts as. Greedy outputs equal the reference
(tests/engine/reference.py). The CUDA tests run on a GPU machine (the device tool), not in CI."""

import asyncio
import time

import pytest
import torch

from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.prefill_pacing import MIN_TOKENS, REFRESH
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.static_models import FRESH_CTX
from ddserve.engine.static_prefill import fresh_chunks
from ddserve.engine.weights import random_llama, tiny_config
from tests.engine.reference import (
    ReferenceDFlash,
    ReferenceEngine,
)
from tests.engine.test_lossless import random_dflash
from tests.engine.test_static_engine import drafters

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


async def _collect(runner, prompt, n):
    out = []
    async for step in runner.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        out += step.token_ids
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_a_prompt_chunks_last_layer_writes_its_keys_and_values_only(tiny, bias):
    """`kv_step` (a prompt chunk's last layer when nothing taps it) writes the keys and values
    `layer_step` writes, entry for entry (with a QKV bias too), and nothing else."""
    from ddserve.engine.attention import plan
    from ddserve.engine.static import fuse_weights, kv_step, layer_step

    block = tiny.layers[-1]
    fuse_weights(block)
    cfg = tiny.cfg
    if bias:
        block.qkv_bias = torch.randn(
            block.qkv_weight.shape[0], generator=torch.Generator().manual_seed(1)
        )
    gen = torch.Generator().manual_seed(4)
    b, w, slots, length = 2, 5, 3, 16
    x = torch.randn(b * w, cfg.hidden_size, generator=gen)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    cos, sin = tiny.rope(pos.view(-1))
    rows = torch.tensor([2, 0])
    pools = []
    for step in ("layer", "kv"):
        kc = torch.randn(
            slots,
            cfg.num_kv_heads,
            length,
            cfg.head_dim,
            generator=torch.Generator().manual_seed(7),
        )
        vc = kc.clone() + 1
        if step == "layer":
            lens = torch.tensor([3, 0])
            attn = plan(
                "sdpa", lens, 1, None, w, length, cfg.num_heads // cfg.num_kv_heads, x.dtype
            )
            layer_step(block, x, cos, sin, kc, vc, rows, pos, attn, False)
        else:
            kv_step(block, x, cos, sin, kc, vc, rows, pos)
        pools.append((kc, vc))
    block.qkv_bias = None
    (k1, v1), (k2, v2) = pools
    assert torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
    init = torch.randn(k1.shape, generator=torch.Generator().manual_seed(7))
    assert not torch.equal(k2[2, :, 3:8], init[2, :, 3:8])  # written
    assert torch.equal(k2[1], init[1]) and torch.equal(v2[1], init[1] + 1)  # slot 1: untouched


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("drafter", ["none", "dflash-untrained"])
def test_prompt_chunks_after_warm_up_equal_reference_fp32(device, drafter):
    """After the warm-up (CUDA), prompts whose chunk shapes were not captured run without a
    graph (exact widths, one forward for a long prompt on an idle engine, a budgeted call's
    share while others decode): no new prefill graph is captured, and every answer (tokens,
    accept lengths) equals the reference's, alone and joining running requests."""
    model = random_llama(tiny_config(vocab_size=512), seed=3).to(device)
    params = LiveParams(budget=6, topk=2)
    make = drafters(model)[drafter]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (700, 333, 37, 290)]
    ref = ReferenceEngine(model, make(), 6, ())
    alone = [ref.generate(p, SamplingParams(max_tokens=12), params) for p in prompts]
    eng = StaticEngine(model, make(), 6, (), slots=8, max_context=1024, graphs=device == "cuda")
    eng.warm_up(params)
    captured = {k for k in eng.target.graphs.graphs if not k[0]}
    mine = [eng.generate(p, SamplingParams(max_tokens=12), params) for p in prompts]
    assert [s.output for s in mine] == [s.output for s in alone]
    assert [s.stats.accept_lengths for s in mine] == [s.stats.accept_lengths for s in alone]
    # two running, two joining with a budget of 100 prompt tokens a round
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=12)) for p in prompts]
    for s in seqs[:2]:
        eng.prefill(s)
    while not all(s.finished for s in seqs):
        joining = [s for s in seqs[2:] if not eng.prefilled(s)]
        if joining:
            eng.prefill_batch(joining, max_tokens=100)
        eng.step_batch([s for s in seqs if eng.prefilled(s) and not s.finished], params)
    assert [s.output for s in seqs] == [s.output for s in alone]
    assert {k for k in eng.target.graphs.graphs if not k[0]} == captured
    for s in seqs:
        eng.release(s)
    assert eng.free_slots == 8


@pytest.mark.parametrize("chunk", [None, 40], ids=["whole", "chunked"])
def test_batched_prefill_of_long_and_short_prompts(tiny, chunk):
    """Prompts of 1 to 300 tokens prefilled together (several chunks, rows of one forward),
    whole or at most 40 tokens per call (the runner's chunked prefill, over several calls),
    then decoded in lockstep with a DFlash drafter: the reference engine's output and accept
    lengths for each."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[1], [1, 7, 8], torch.randint(3, 500, (300,), generator=gen).tolist()]
    prompts.append(torch.randint(3, 500, (70,), generator=gen).tolist())
    params = LiveParams(budget=8, topk=2)
    draft = random_dflash(tiny)
    ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
    alone = [ref.generate(p, SamplingParams(max_tokens=20), params) for p in prompts]
    eng = StaticEngine(
        tiny, DFlashDrafter(draft, tiny), 6, (), slots=4, max_context=512, graphs=False
    )
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=20)) for p in prompts]
    if chunk is None:
        eng.prefill_batch(seqs)
    else:
        calls = 0
        while not all(eng.prefilled(s) for s in seqs):
            before = sum(s.cache.length for s in seqs)
            eng.prefill_batch(seqs, max_tokens=chunk)
            calls += 1
            # forwards of 16-token chunks (the widest within 40) until 40 went in: 40 + 3 x 16
            assert 0 < sum(s.cache.length for s in seqs) - before <= chunk + 3 * 16
        assert calls >= 299 // chunk
    while not all(s.finished for s in seqs):
        eng.step_batch([s for s in seqs if not s.finished], params)
    assert [s.output for s in seqs] == [s.output for s in alone]
    assert [s.stats.accept_lengths for s in seqs] == [s.stats.accept_lengths for s in alone]


@pytest.mark.parametrize("shapes", ["captured", "exact"])
def test_a_prefill_budget_bounds_the_whole_call(tiny, shapes):
    """A budgeted prefill spends at most the budget, over all the rows of a forward.
    Shapes with graphs ("captured": chunks of 16/64/256 here): one prompt and 100 tokens ->
    one forward of 64 (the widest chunk within it; a forward costs about the same whatever
    its width, so no 16 + 16 after it), 300 -> 256. Without graphs
    ("exact", as on CPU or for a shape not captured on a GPU): one forward of exactly the
    budget. Three long prompts: first come first, the oldest takes the whole budget and the
    others wait for it (a budget shared among them made every one of them finish last)."""
    gen = torch.Generator().manual_seed(5)
    eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=4, max_context=512, graphs=False)
    if shapes == "captured":  # as if every chunk shape had a graph: padded to them
        eng.target.prefill_eager = lambda key: False
    long = [torch.randint(3, 500, (300,), generator=gen).tolist() for _ in range(4)]
    extra = eng.new_sequence(long[0] + long[1][:150], SamplingParams(max_tokens=4))
    assert eng.prefill_batch([extra], max_tokens=300) == (256 if shapes == "captured" else 300)
    eng.release(extra)
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=4)) for p in long]
    eng.prefill_batch(seqs[:1], max_tokens=100)
    assert seqs[0].cache.length == (64 if shapes == "captured" else 100)
    calls = 0
    while not all(eng.prefilled(s) for s in seqs[1:]):
        assert eng.prefill_batch(seqs[1:], max_tokens=100) <= 100
        calls += 1
        lengths = [s.cache.length for s in seqs[1:]]
        # first come first: those before the one going in are in, those after untouched
        at = next((i for i, n in enumerate(lengths) if n < 299), 3)
        assert lengths[:at] == [299] * at and lengths[at + 1 :] == [0] * len(lengths[at + 1 :])
    assert calls <= -(-3 * 299 // (64 if shapes == "captured" else 100)) + 1  # budgets used
    before = sum(s.cache.length for s in seqs)
    eng.prefill_batch(seqs, max_tokens=200)
    assert 0 < sum(s.cache.length for s in seqs) - before <= 200
    for seq in seqs:  # and what went in is the prompt: it decodes like a whole prefill
        eng.prefill(seq)
    ref = StaticEngine(tiny, NoDrafter(), 6, (), slots=4, max_context=512, graphs=False)
    whole = [ref.new_sequence(p, SamplingParams(max_tokens=4)) for p in long]
    ref.prefill_batch(whole)
    for e, ss in ((eng, seqs), (ref, whole)):
        while not all(s.finished for s in ss):
            e.step_batch([s for s in ss if not s.finished], LiveParams(budget=0))
    assert [s.output for s in seqs] == [s.output for s in whole]


@pytest.mark.parametrize("shapes", ["captured", "exact"])
def test_a_budget_admits_short_prompts_whole_and_first_come_first(tiny, shapes):
    """A budgeted call (the runner's while others decode) takes short prompts whole, in
    order, as many as fit: a burst of 40-token prompts with a budget of 100 goes in two per
    call, none cut into narrow chunks (each answer's first token one round after its
    prompt). A prompt longer than the whole budget takes what older ones leave, at least the
    narrowest chunk, and younger ones wait for it: first come first."""
    gen = torch.Generator().manual_seed(8)
    eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=8, max_context=512, graphs=False)
    if shapes == "captured":
        eng.target.prefill_eager = lambda key: False
    burst = [torch.randint(3, 500, (41,), generator=gen).tolist() for _ in range(5)]
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=2)) for p in burst]
    admitted = []
    while not all(eng.prefilled(s) for s in seqs):
        eng.prefill_batch([s for s in seqs if not eng.prefilled(s)], max_tokens=100)
        assert {s.cache.length for s in seqs} <= {0, 40}  # whole or not at all
        admitted.append(sum(eng.prefilled(s) for s in seqs))
    assert admitted == [2, 4, 5]
    for s in seqs:
        eng.release(s)
    want = 64 if shapes == "captured" else 100  # the widest chunk within it, or exactly 100
    long = eng.new_sequence(torch.randint(3, 500, (301,), generator=gen).tolist(), SamplingParams())
    shorts = [eng.new_sequence(p, SamplingParams(max_tokens=2)) for p in burst[:2]]
    # short ones ahead of a long prompt go in whole and it takes what they leave (20: a
    # 16-wide chunk)
    spent = eng.prefill_batch([*shorts, long], max_tokens=100)
    assert all(eng.prefilled(s) for s in shorts)
    assert spent - 80 == long.cache.length == (16 if shapes == "captured" else 20)
    for s in [long, *shorts]:
        eng.release(s)
    # younger short prompts (chat turns) go ahead of an older long one within half the
    # budget (one of 40 tokens in 50), the rest wait; the long one moves every call by
    # what is left (60: a 16-wide chunk)
    long = eng.new_sequence(torch.randint(3, 500, (301,), generator=gen).tolist(), SamplingParams())
    moved, rest = [], 16 if shapes == "captured" else 60
    for _ in range(3):
        shorts = [eng.new_sequence(p, SamplingParams(max_tokens=2)) for p in burst[:3]]
        before = long.cache.length
        assert eng.prefill_batch([long, *shorts], max_tokens=100) <= 100
        moved.append(long.cache.length - before)
        assert [s.cache.length for s in shorts] == [40, 0, 0]
        for s in shorts:
            eng.release(s)
    assert moved == [rest] * 3
    eng.release(long)
    # a younger prompt over SHORT_TOKENS waits for the older long one, which takes the budget
    long = eng.new_sequence(torch.randint(3, 500, (301,), generator=gen).tolist(), SamplingParams())
    other = eng.new_sequence(
        torch.randint(3, 500, (270,), generator=gen).tolist(), SamplingParams()
    )
    assert eng.prefill_batch([long, other], max_tokens=200) == long.cache.length
    assert other.cache.length == 0 and long.cache.length == (64 if shapes == "captured" else 200)
    for s in (long, other):
        eng.release(s)
    # a budget under the narrowest chunk still moves the oldest long prompt by one
    long = eng.new_sequence(torch.randint(3, 500, (301,), generator=gen).tolist(), SamplingParams())
    assert eng.prefill_batch([long], max_tokens=5) == 16
    eng.release(long)
    # no budget: nothing; many long prompts: the oldest alone, within the budget
    many = [
        eng.new_sequence(torch.randint(3, 500, (200,), generator=gen).tolist(), SamplingParams())
        for _ in range(7)
    ]
    assert eng.prefill_batch(many, max_tokens=0) == 0
    assert eng.prefill_batch(many, max_tokens=100) == want
    assert [s.cache.length for s in many] == [want] + [0] * 6


@pytest.mark.parametrize(
    "chunk,steps,overlap,device",
    [
        (16, 0, "off", "cpu"),
        (-1, 0, "off", "cpu"),
        (-1, 0.05, "off", "cpu"),
        (16, 0, "on", "cpu"),
        (-1, 0.05, "on", "cpu"),
        pytest.param(16, 0, "on", "cuda", marks=cuda),
        pytest.param(-1, 0.05, "on", "cuda", marks=cuda),
    ],
    ids=[
        "16-tokens",
        "no-limit",
        "paced",
        "16-tokens-overlap",
        "paced-overlap",
        "cuda-16-tokens-overlap",
        "cuda-paced-overlap",
    ],
)
def test_long_prompt_is_admitted_between_running_rounds(chunk, steps, overlap, device):
    """A 300-token prompt arrives while a request is decoding. With chunked_prefill_size=16
    the running request keeps getting tokens while the prompt goes in (many of its rounds
    pass before the newcomer's first token); with -1 (no limit) the prompt goes in at once;
    with no token cap but chunked_prefill_steps=0.05 (chunks paced to a twentieth of a decode
    step, at least MIN_TOKENS) a 1,900-token prompt over many rounds again. Every answer is
    what each gets alone. overlap_prefill on: the chunks run beside the running request's
    steps (on a GPU on a stream of their own, fp32 there; here in order, the newcomer decoded
    from the round after its last chunk): the same answers."""
    cfg = EngineConfig(
        model="tiny-random",
        device=device,
        dtype="float32",
        max_batch=2,
        chunked_prefill_size=chunk,
        chunked_prefill_steps=steps,
        overlap_prefill=overlap,
        drafter={"kind": "none"},
        params={"budget": 0},
    )
    runner = EngineRunner(cfg)
    runner.start()
    beside = []  # rounds in a row stepped beside a chunk, after each such round
    stepped_beside = runner.pacer.stepped_beside

    def count():
        stepped_beside()
        beside.append(runner.pacer.rounds_beside)

    runner.pacer.stepped_beside = count
    n_long = 1900 if steps else 300
    long_prompt = torch.randint(3, 500, (n_long,), generator=torch.Generator().manual_seed(2))
    long_prompt = long_prompt.tolist()
    try:

        async def stream(prompt, n, events, name):
            out = []
            sp = SamplingParams(max_tokens=n, ignore_eos=True)
            async for step in runner.generate(prompt, sp):
                out += step.token_ids
                events.append(name)
            return out

        async def main():
            events: list[str] = []
            short = asyncio.create_task(stream([1, 5, 9], 80, events, "short"))
            while not events:
                await asyncio.sleep(0.001)
            n0 = len(events)
            long = await stream(long_prompt, 4, events, "long")
            during = events[n0 : events.index("long")].count("short")
            return await short, long, during

        short, long, during = asyncio.run(main())
        if chunk == 16:
            assert during >= 10, during
        elif steps:  # a first chunk of FIRST_TOKENS, then paced ones, each beside (or
            # after) a step of the running request; how many depends on the device's timings
            # (1,900 tokens: 8 rounds of chunks on this CPU; on an H100 the running request
            # stepped 5 times meanwhile). Without the overlap, the pacer's count is the
            # chunks that ended no prompt (all but the last)
            chunk_rounds = len(beside) if overlap == "on" else runner.pacer.count
            floor = 6 if device == "cpu" else 3
            assert chunk_rounds >= floor and during >= chunk_rounds, (during, beside)
            assert runner.pacer.chunks
            assert runner.load_gauges()["prefill_chunk_tokens"] >= MIN_TOKENS
        else:
            assert during <= 3, during
        if overlap == "on" and chunk == 16:  # 19 chunks: a plain step (timed) after 16
            assert len(beside) > REFRESH and max(beside) == REFRESH, beside
        assert short == asyncio.run(asyncio.wait_for(_collect(runner, [1, 5, 9], 80), 60))
        assert long == asyncio.run(asyncio.wait_for(_collect(runner, long_prompt, 4), 60))
    finally:
        runner.shutdown()


def test_an_idle_engine_whose_prefills_are_slow_takes_a_long_prompt_in_chunks(monkeypatch):
    """Idle, a long prompt goes in whole while the engine's prefills are fast (the first one
    past the cap after a first chunk that times them); once its own timed prefills say a
    prompt that long takes over IDLE_WHOLE_S (here made tiny: a CPU's ~7 ms a token), it goes
    in `--chunked-prefill-size` tokens a round, so a short request arriving meanwhile is
    answered after one chunk; every answer as alone."""
    import ddserve.engine.prefill_pacing as pacing

    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        dtype="float32",
        max_batch=2,
        chunked_prefill_size=256,
        drafter={"kind": "none"},
        params={"budget": 0},
    )
    runner = EngineRunner(cfg)
    runner.start()
    chunks = []  # prompt tokens each prefill call put in
    prefill = runner.engine.prefill_batch

    def counted(seqs, budget=None, overlap=False):
        before = sum(s.cache.length for s in seqs)
        out = prefill(seqs, budget, overlap=overlap)
        chunks.append(sum(s.cache.length for s in seqs) - before)
        return out

    runner.engine.prefill_batch = counted
    gen = torch.Generator().manual_seed(4)
    first, second = (torch.randint(3, 500, (900,), generator=gen).tolist() for _ in range(2))
    try:
        alone = asyncio.run(asyncio.wait_for(_collect(runner, first, 2), 60))
        # nothing timed yet: one chunk of the cap, timed; fast enough, the rest whole
        assert chunks[:2] == [256, 899 - 256], chunks
        assert runner.pacer.token_rates
        monkeypatch.setattr(pacing, "IDLE_WHOLE_S", 1e-9)
        chunks.clear()
        assert asyncio.run(asyncio.wait_for(_collect(runner, second, 2), 60)) == asyncio.run(
            asyncio.wait_for(_collect(runner, second, 2), 60)
        )
        assert len(chunks) >= 4 and max(chunks) <= 256, chunks
        assert asyncio.run(asyncio.wait_for(_collect(runner, first, 2), 60)) == alone
    finally:
        runner.shutdown()


def test_a_wait_behind_older_prompts_counts_as_queue_time():
    """Request phases (vLLM's): a younger long prompt waiting for an older one (first come
    first served, with its sequence already made) is queued until its own first tokens go
    in, so its queue time holds the older one's prefill; queue <= first token <= finish."""
    cfg = EngineConfig(
        model="tiny-random", device="cpu", max_batch=4, max_context=2048,
        drafter={"kind": "none"}, params={"budget": 0, "topk": 1},
        chunked_prefill_size=256, chunked_prefill_steps=0,
    )  # fmt: skip
    runner = EngineRunner(cfg)
    runner.start()
    starts, rows = {}, runner.engine._prefill_rows

    def recording(seqs, quotas):  # when each prompt's first prefill forward began
        now = time.perf_counter()
        for s in seqs:
            starts.setdefault(s.tokens[1], now)
        return rows(seqs, quotas)

    runner.engine._prefill_rows = recording

    async def collect(prompt, n):
        async for out in runner.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            last = out
        return last.stats

    async def main():
        running = asyncio.create_task(collect([1, 5, 6], 1500))  # decoding: a paced budget
        await asyncio.sleep(0.3)
        # (an engine idle when they come prefills both whole, together: CI once finished
        # 300 tokens in those 0.3 s)
        assert not running.done()
        older = asyncio.create_task(collect([1] + [7] * 1500, 2))
        younger = asyncio.create_task(collect([1] + [9] * 1500, 2))
        out = await older, await younger
        await running
        return out

    try:
        older, younger = asyncio.run(main())
    finally:
        runner.shutdown()
    waited = starts[9] - starts[7]
    assert waited > 0.01  # the younger one's prompt went in after the older one's began
    assert younger.queue_s - older.queue_s > 0.5 * waited
    for st in (older, younger):
        assert 0 < st.queue_s <= st.first_token_s <= st.finish_s


def test_which_prompt_chunks_run_without_a_graph(tiny):
    """Without graphs (CPU) every prompt chunk runs eagerly, exact. With graphs: before the
    warm-up is done a new chunk shape is captured on first use; after it, only the shapes the
    warm-up captured replay and any other runs without a graph (a capture while others decode
    would stall them), through the plain layers, not the compiled ones."""
    eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=4, max_context=512, graphs=False)
    target = eng.target
    assert target.prefill_eager((False, 1, 16, 512))
    target.graphs.enabled = True  # the decision alone (nothing is captured on a CPU)
    target.graphs.graphs = {(False, 1, 16, 512): None}
    assert not target.prefill_eager((False, 1, 1024, 2048))  # captured on first use
    target.capture_prefill = False  # as the warm-up leaves it
    assert not target.prefill_eager((False, 1, 16, 512))
    assert target.prefill_eager((False, 1, 1024, 2048))
    assert target.prefill_eager((False, 3, 40, 512))

    def compiled(*args, **kwargs):
        raise AssertionError("a prompt chunk without a graph ran the compiled layer")

    # such a chunk runs the plain layer: a compiled one would recompile for a new shape
    target.layer = compiled
    seq = eng.new_sequence(list(range(3, 43)), SamplingParams(max_tokens=1))
    eng.prefill(seq)
    assert eng.prefilled(seq)


def test_rows_that_only_fill_a_wide_chunk_write_no_real_entry(tiny):
    """A prompt-chunk forward under a graph pads its rows to a power of two with rows that
    write into the guard entries of the chunk's own first prompt's slot only: with chunks
    wider than the guard (1,024 with triton, here on sdpa with its widths), three prompts
    joining pad to four rows, and the request in slot 0, near the end of its context, keeps
    every entry of its slot, guard included (its next tree may reach into the guard while
    such a chunk runs beside its step: overlapped prefill), and its answer."""
    gen = torch.Generator().manual_seed(1)
    victim = torch.randint(3, 500, (1500,), generator=gen).tolist()
    others = [torch.randint(3, 500, (1101,), generator=gen).tolist() for _ in range(3)]
    outs = []
    for interfere in (False, True):
        eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=4, max_context=1536, graphs=False)
        eng.chunks = (16, 64, 256, 512, 1024)  # as with triton (the pool is 2,048 long here)
        eng.target.prefill_eager = lambda key: False  # as after a warm-up: shapes captured
        seq = eng.new_sequence(victim, SamplingParams(max_tokens=8))
        assert seq.cache.slot == 0
        eng.prefill(seq)
        keys = eng.pool.k[0][0].clone()
        if interfere:
            shapes, forward = [], eng.target.forward
            eng.target.forward = lambda p, b, w, c, r, t=None, f=forward, log=shapes: (
                log.append((b, w)) or f(p, b, w, c, r, t)
            )
            new = [eng.new_sequence(p, SamplingParams(max_tokens=1)) for p in others]
            eng.prefill_batch(new)
            assert (4, 1024) in shapes  # three rows padded to four, wider than the guard
            assert torch.equal(eng.pool.k[0][0], keys)
            eng.target.forward = forward
        while not seq.finished:
            eng.step(seq, LiveParams(budget=0))
        outs.append(seq.output)
    assert outs[0] == outs[1]


def test_a_prompt_that_fits_its_budget_goes_in_whole_past_the_widest_chunk(tiny):
    """Under graphs a prompt cut short by its budget takes the widest chunk within it once;
    one whose rest fits the budget is not cut: 3,000 tokens under a budget of 4,000 go in
    (2,048 + 1,024 wide forwards), and so does a 2,500-token one with a short one behind."""
    gen = torch.Generator().manual_seed(0)
    eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=4, max_context=4096, graphs=False)
    eng.chunks = (16, 64, 256, 512, 1024, 2048)
    eng.target.prefill_eager = lambda key: False
    one = eng.new_sequence(torch.randint(3, 500, (3001,), generator=gen).tolist(), SamplingParams())
    assert eng.prefill_batch([one], max_tokens=4000) == 3000 and eng.prefilled(one)
    eng.release(one)
    two = [
        eng.new_sequence(torch.randint(3, 500, (n + 1,), generator=gen).tolist(), SamplingParams())
        for n in (2500, 30)
    ]
    assert eng.prefill_batch(two, max_tokens=4000) == 2530
    assert all(eng.prefilled(s) for s in two)


@pytest.mark.parametrize("drafter", ["none", "dflash"])
def test_an_idle_engine_prefills_a_long_prompt_in_one_forward(tiny, drafter):
    """Without graphs and with nothing decoding, a prompt longer than the widest chunk goes in
    one forward (two prompts: one forward of both rows), and decodes exactly as one prefilled
    in the fixed chunks of captured shapes, as one whose first chunk (both rows) takes the
    fresh class (attention over the chunk's own keys, one forward up to the pool's width), and
    as one whose fresh chunk is followed by others: the same KV entries, tokens and (DFlash,
    which takes the prompt's tapped states) accept lengths; the last layer's keys depend on
    the attention below it."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (700, 450)]
    draft = random_dflash(tiny) if drafter == "dflash" else None
    outs, pools = [], []
    for shapes in ("exact", "captured", "fresh", "fresh-then-chunks"):
        d = DFlashDrafter(draft, tiny) if draft is not None else NoDrafter()
        eng = StaticEngine(tiny, d, 6, (), slots=4, max_context=1024, graphs=False)
        if shapes != "exact":
            eng.target.prefill_eager = lambda key: False
        if shapes == "fresh":  # as under graphs: first chunks up to the pool's width
            eng.fresh_chunks = fresh_chunks(eng.pool.max_len)
        elif shapes == "fresh-then-chunks":
            eng.fresh_chunks = (256,)
        forward, widths = eng.target.forward, []

        def counting(packed, b, w, ctx, rows_are_slots, trees=None, forward=forward, widths=widths):
            if not rows_are_slots:
                widths.append((b, w, ctx == FRESH_CTX))
            return forward(packed, b, w, ctx, rows_are_slots, trees)

        eng.target.forward = counting
        seqs = [eng.new_sequence(p, SamplingParams(max_tokens=8)) for p in prompts]
        eng.prefill_batch(seqs)
        if shapes == "exact":
            assert widths == [(2, 699, False)]
            short = eng.new_sequence(prompts[1][:20], SamplingParams(max_tokens=1))
            other = eng.new_sequence(prompts[0] + [7], SamplingParams(max_tokens=1))
            eng.prefill_batch([other, short])  # under half the width: a forward of its own
            assert widths[1:] == [(1, 700, False), (1, 19, False)] and eng.prefilled(short)
            eng.release(short)
            eng.release(other)
        elif shapes == "captured":  # 256-wide chunks (this engine's widest), rows padded
            assert widths == [(2, 256, False)] * 2 + [(1, 256, False)]
        elif shapes == "fresh":  # both first chunks in one forward of the fresh class
            assert widths == [(2, 1024, True)]
        else:  # a fresh first chunk, then the rest in chunks after it
            assert widths == [(2, 256, True), (2, 256, False), (1, 256, False)]
        pools.append(
            [(eng.target.pool.k[-1][s.cache.slot, :, : s.cache.length].clone()) for s in seqs]
        )
        while not all(s.finished for s in seqs):
            eng.step_batch([s for s in seqs if not s.finished], LiveParams(budget=4, topk=2))
        outs.append([(s.output, s.stats.accept_lengths) for s in seqs])
    assert all(out == outs[0] for out in outs[1:])
    for other in pools[1:]:
        for a, b in zip(pools[0], other, strict=True):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
