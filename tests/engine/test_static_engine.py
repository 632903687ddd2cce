"""The engine (KV pool, fixed-shape forwards, CUDA graphs on a GPU) decodes exactly like
the reference (tests/engine/reference.py): same greedy tokens and accept lengths for every drafter, alone and in
batches with late joiners; sampling follows the target distribution; slots are returned.
The CUDA tests run on a GPU machine (the device tool), not in CI."""

import asyncio
import time

import pytest
import torch

from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import NGramDrafter, NoDrafter
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.static_models import FRESH_CTX
from ddserve.engine.static_prefill import fresh_chunks, fresh_rows
from ddserve.engine.weights import random_llama, tiny_config
from ddserve.errors import EngineError
from tests.engine.reference import (
    ReferenceDFlash,
    ReferenceEngine,
    record_trees,
    runner_together_and_alone,
)
from tests.engine.test_batching import PROMPTS, check_batched_sampling, run_lockstep
from tests.engine.test_lossless import assert_logprobs_match, plain_greedy, random_dflash

LENGTHS = [30, 12, 25, 40, 5]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def drafters(model):
    return {
        "none": lambda: NoDrafter(),
        "ngram": lambda: NGramDrafter(model.cfg.vocab_size),
        "dflash-untrained": lambda: ReferenceDFlash(random_dflash(model), model),
    }


def compare(model, graphs: bool, configs):
    for budget, topk, window in configs:
        params = LiveParams(budget=budget, topk=topk, window=window)
        for name, make in drafters(model).items():
            ref = ReferenceEngine(model, make(), 6, ())
            alone = [
                ref.generate(p, SamplingParams(max_tokens=n), params)
                for p, n in zip(PROMPTS, LENGTHS, strict=True)
            ]
            eng = StaticEngine(model, make(), 6, (), slots=8, max_context=256, graphs=graphs)
            mine = [
                eng.generate(p, SamplingParams(max_tokens=n), params)
                for p, n in zip(PROMPTS, LENGTHS, strict=True)
            ]
            label = f"{name} budget={budget} topk={topk} window={window}"
            assert [s.output for s in mine] == [s.output for s in alone], label
            assert [s.stats.accept_lengths for s in mine] == [
                s.stats.accept_lengths for s in alone
            ], label
            assert eng.free_slots == 8  # generate() returned its slot
            together = run_lockstep(
                eng,
                PROMPTS,
                [SamplingParams(max_tokens=n) for n in LENGTHS],
                params,
                join_late={2, 4},
            )
            assert together == [s.output for s in alone], label
            if graphs:
                assert eng.target.graphs.enabled and eng.target.graphs.graphs, label


def test_engine_equals_reference_cpu(tiny):
    compare(tiny, False, [(0, 1, 2048), (6, 2, 2048), (16, 4, 4), (40, 8, 64)])


def test_static_sampling_follows_target_distribution():
    check_batched_sampling(
        lambda target, drafter: StaticEngine(
            target, drafter, 3, (), slots=8, max_context=64, graphs=False
        ),
        n=1600,
        tv=0.06,
    )


def test_slots_are_bounded_and_reused(tiny):
    eng = StaticEngine(tiny, NoDrafter(), 6, (), slots=2, max_context=64, graphs=False)
    a = eng.new_sequence([1, 2], SamplingParams(max_tokens=4))
    b = eng.new_sequence([1, 3], SamplingParams(max_tokens=4))
    with pytest.raises(EngineError, match="KV slots"):
        eng.new_sequence([1, 4], SamplingParams(max_tokens=4))
    eng.release(a)
    c = eng.new_sequence([1, 4], SamplingParams(max_tokens=4))
    assert c.cache.slot == 0 and b.cache.slot == 1
    with pytest.raises(EngineError, match="exceeds"):
        eng.new_sequence(list(range(1, 100)), SamplingParams(max_tokens=4))


def test_runner_queues_requests_beyond_the_pool():
    """8 concurrent requests through a runner with 2 KV slots: all finish, each with the
    output it has alone, and every slot comes back."""
    cfg = EngineConfig(
        model="tiny-random", device="cpu", max_batch=2, graphs="on", params={"budget": 4, "topk": 2}
    )
    runner = EngineRunner(cfg)
    runner.start()
    try:
        assert isinstance(runner.engine, StaticEngine)

        together, alone = runner_together_and_alone(runner, 8, 12)
        assert together == alone and all(len(o) == 12 for o in together)
        deadline = time.monotonic() + 5  # the worker releases a slot after the round
        while runner.engine.free_slots != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.engine.free_slots == 2
    finally:
        runner.shutdown()


def plain_logprobs(model, prompt, tokens):
    """log_softmax of a plain forward's logits before each of `tokens` (the oracle)."""
    out = []
    for i in range(len(tokens)):
        ids = prompt + tokens[:i]
        logits = model(
            torch.tensor(ids, device=model.device),
            torch.arange(len(ids), device=model.device),
            model.new_cache(capacity=len(ids) + 8),
        )[-1]
        out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_logprobs_and_logit_bias_in_mixed_batches(tiny, device):
    """Requests with log-probs, with a logit_bias, with both and with neither share rounds
    (two join late): each gets the reference engine's output for it alone, its log-probs are a
    plain forward's log_softmax at every emitted position, and requests that did not ask get
    none. The sampled one never emits the token its bias forbids. On CUDA: graphs on."""
    model = tiny if device == "cpu" else random_llama(tiny_config(vocab_size=512), seed=3).cuda()
    params = LiveParams(budget=6, topk=2)
    unbiased, _ = plain_greedy(model, PROMPTS[1], 4)
    bias = ((unbiased[1], -100.0), (300, 1.5), (7, 4.0))
    sampling = [
        SamplingParams(max_tokens=16, logprobs=2),
        SamplingParams(max_tokens=12, logit_bias=bias),
        SamplingParams(max_tokens=12, logprobs=0, logit_bias=bias),
        SamplingParams(max_tokens=20),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=4, logit_bias=bias),
    ]
    ref = ReferenceEngine(model, NGramDrafter(512), 6, ())
    alone = [ref.generate(p, sp, params) for p, sp in zip(PROMPTS, sampling, strict=True)]
    eng = StaticEngine(model, NGramDrafter(512), 6, (), slots=8, max_context=256, graphs=True)
    seqs = [eng.new_sequence(p, sp) for p, sp in zip(PROMPTS, sampling, strict=True)]
    joined: set[int] = set()
    for rnd in range(100):
        for i, seq in enumerate(seqs):
            if i not in joined and (i not in (2, 4) or rnd >= 2):
                eng.prefill(seq)
                joined.add(i)
        active = [s for i, s in enumerate(seqs) if i in joined and not s.finished]
        if not active and len(joined) == len(seqs):
            break
        eng.step_batch(active, params)
    for i in (0, 1, 2, 3):  # greedy: token for token the reference's
        assert seqs[i].output == alone[i].output, i
    assert seqs[1].logprobs is None and seqs[3].logprobs is None
    assert seqs[1].output != ref.generate(PROMPTS[1], SamplingParams(max_tokens=12), params).output
    assert unbiased[1] not in seqs[4].output and len(seqs[4].output) == 12
    for i, k in ((0, 2), (2, 0), (4, 4)):
        s = seqs[i]
        assert_logprobs_match(s.logprobs, s.output, plain_logprobs(model, s.prompt, s.output), k)
    if device == "cuda":
        assert eng.target.graphs.graphs


@cuda
def test_graphs_equal_reference_cuda_fp32():
    model = random_llama(tiny_config(vocab_size=512), seed=3).cuda()
    compare(model, True, [(0, 1, 2048), (6, 2, 2048), (16, 4, 4)])


def test_drafter_context_catch_up_equals_the_indexed_write(tiny):
    """A prompt's drafter context goes in by slice copies (`StaticDraft.extend`); the draft
    graph's indexed write of the same features at the same positions leaves the same pool,
    bit for bit, and touches nothing else."""
    eng = StaticEngine(
        tiny, DFlashDrafter(random_dflash(tiny), tiny), 6, (), slots=4, max_context=256,
        graphs=False,
    )  # fmt: skip
    sd = eng.sdraft
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(37, sd.feats.shape[-1], generator=gen)
    sd.extend(2, 5, taps)
    sliced = (sd.pool.k.clone(), sd.pool.v.clone())
    sd.pool.k.zero_()
    sd.pool.v.zero_()
    sd._write_context(taps, torch.tensor([2]), torch.arange(5, 42)[None])
    assert torch.equal(sliced[0], sd.pool.k) and torch.equal(sliced[1], sd.pool.v)
    assert sliced[0][:, 2, :, 5:42].abs().sum() > 0  # written ...
    assert (
        sliced[0][:, 2, :, 42:].abs().sum() == 0 == sliced[0][:, :2].abs().sum()
    )  # ... only there


def test_spec_max_batch_switches_crowded_rounds_to_plain_decoding():
    """With spec_max_batch=1, rounds of several requests verify roots only: outputs stay
    those of each request alone, in more rounds. (Budget-0 rounds with a DFlash drafter,
    which still write its context, are in test_engine_equals_reference_cpu.)"""
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=4,
        graphs="on",
        spec_max_batch=1,
        drafter={"kind": "ngram"},
        params={"budget": 6, "topk": 2},
    )
    runner = EngineRunner(cfg)
    runner.start()
    try:

        async def one(p):
            out, stats = [], None
            async for step in runner.generate(p, SamplingParams(max_tokens=24, ignore_eos=True)):
                out += step.token_ids
                stats = step.stats
            return out, stats

        async def main():
            prompts = [[1, 5, 6, 5, 6, 5, 6] * 3, [1, 9, 9, 9, 9, 9] * 3, [1, 4, 4, 2] * 4]
            together = await asyncio.gather(*(one(p) for p in prompts))
            alone = [await one(p) for p in prompts]
            return together, alone

        together, alone = asyncio.run(main())
        assert [o for o, _ in together] == [o for o, _ in alone]
        rounds_together = sum(s.verify_rounds for _, s in together)
        rounds_alone = sum(s.verify_rounds for _, s in alone)
        assert rounds_together > rounds_alone  # crowded rounds drafted nothing
    finally:
        runner.shutdown()


@pytest.mark.parametrize("buffered", [0, 32])
def test_budget_changing_every_round_with_a_dflash_drafter(tiny, buffered, monkeypatch):
    """Rounds whose budget changes (runs of budget-0 rounds, which defer the drafter's context
    write, between drafting rounds of several sizes; adaptive speculation does this) decode
    like the reference engine round for round: the same tokens and accept lengths, so every
    draft saw its whole context. Two requests share the rounds, one joins late. A slot buffers
    a draft's 7 feature rows (block 6 + root) or 32 (BUFFERED_ROWS): budget-0 runs of 12 and
    40 rounds fill either, and a run of 12 leaves more than a draft's rows to write first."""
    from ddserve.engine import static_dflash

    monkeypatch.setattr(static_dflash, "BUFFERED_ROWS", buffered)
    draft = random_dflash(tiny)
    ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
    eng = StaticEngine(
        tiny, DFlashDrafter(draft, tiny), 6, (), slots=4, max_context=256, graphs=False
    )
    assert eng.sdraft.rows == max(7, buffered)
    schedule = [8, 0, 0, 3, *[0] * 12, 16, 1, 0, 0, 0, 7, *[0] * 5, 8, 8, *[0] * 40, 16]
    outs = []
    for e in (ref, eng):
        trees = record_trees(e)  # the drafts themselves must agree
        seqs = [e.new_sequence(p, SamplingParams(max_tokens=120)) for p in PROMPTS[:2]]
        e.prefill(seqs[0])
        for rnd, budget in enumerate(schedule * 2):
            if rnd == 5:
                e.prefill(seqs[1])
            active = [s for s in seqs[: 1 + (rnd >= 5)] if not s.finished]
            if active:
                e.step_batch(active, LiveParams(budget=budget, topk=2))
        outs.append(([(s.output, s.stats.accept_lengths) for s in seqs], trees))
    assert outs[0] == outs[1]
    assert sum(len(t) > 1 for t in outs[1][1]) > 20  # many rounds drafted


def test_a_draft_that_raises_loses_no_context(tiny):
    """The DFlash draft forward raises in some rounds (after budget-0 rounds buffered their
    feature rows): the round fails before any commit and is run again, and the drafts that
    follow are the reference's, tree for tree (no context row was dropped)."""
    draft = random_dflash(tiny)
    ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
    eng = StaticEngine(
        tiny, DFlashDrafter(draft, tiny), 6, (), slots=2, max_context=256, graphs=False
    )
    forward, calls = eng.sdraft.forward, []

    def flaky(packed, key):
        calls.append(key)
        if len(calls) % 3 == 0:
            raise RuntimeError("injected draft failure")
        return forward(packed, key)

    eng.sdraft.forward = flaky
    schedule = [8, 0, 0, 0, 3, 0, 16, 0, 0, 8]
    outs = []
    for e in (ref, eng):
        trees = record_trees(e)
        seq = e.new_sequence(PROMPTS[0], SamplingParams(max_tokens=40))
        e.prefill(seq)
        failures = 0
        for budget in schedule * 4:
            if seq.finished:
                break
            try:
                e.step_batch([seq], LiveParams(budget=budget, topk=2))
            except RuntimeError:
                failures += 1
                e.step_batch([seq], LiveParams(budget=budget, topk=2))  # the retry
        outs.append((seq.output, trees))
    assert failures > 0
    assert outs[0] == outs[1]


def test_trees_at_the_end_of_the_context(tiny):
    """A request that fills its context to the last entry while verifying 17-node trees:
    the trees' pending entries run into the slot's guard, the output is the reference's."""
    params = LiveParams(budget=16, topk=4)
    prompt = [1] + [5, 6, 7, 8] * 10  # 41 tokens + 23 new = the whole 64-token context
    draft = random_dflash(tiny)
    ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
    want = ref.generate(prompt, SamplingParams(max_tokens=23), params).output
    eng = StaticEngine(
        tiny, DFlashDrafter(draft, tiny), 6, (), slots=2, max_context=64, graphs=False
    )
    assert eng.pool.usable == 64
    assert eng.generate(prompt, SamplingParams(max_tokens=23), params).output == want


def test_compiled_layers_decode_like_eager_ones(tiny):
    """The GPU default compiles the decoder layer (torch.compile, dynamic shapes); inductor's
    CPU backend runs the same graph here: outputs equal the reference engine's, across batch
    sizes and tree widths that share one compilation."""
    ref = ReferenceEngine(tiny, NGramDrafter(512), 6, ())
    eng = StaticEngine(
        tiny, NGramDrafter(512), 6, (), slots=8, max_context=256, graphs=False, compile=True
    )
    for budget, topk in [(0, 1), (6, 2)]:
        params = LiveParams(budget=budget, topk=topk)
        alone = [
            ref.generate(p, SamplingParams(max_tokens=n), params).output
            for p, n in zip(PROMPTS, LENGTHS, strict=True)
        ]
        sampling = [SamplingParams(max_tokens=n) for n in LENGTHS]
        assert run_lockstep(eng, PROMPTS, sampling, params, join_late={2}) == alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_compiled_glue_drafts_and_verifies_like_the_reference(device):
    """With compile on, the forwards' glue is compiled too (static_models.glue_compiled: the
    drafter's context entries written in one indexed write, its block's inputs, its top k;
    the verify's head): a DFlash engine's greedy tokens (fp32) equal the reference engine's,
    alone and in lockstep, at two tree shapes; on a GPU under CUDA graphs, with the trees
    built there."""
    model = random_llama(tiny_config(vocab_size=512), seed=3).to(device)
    draft = random_dflash(model).to(device)
    ref = ReferenceEngine(model, ReferenceDFlash(draft, model), 6, ())
    eng = StaticEngine(
        model, DFlashDrafter(draft, model), 6, (), slots=4, max_context=256,
        graphs=device == "cuda", compile=True,
    )  # fmt: skip
    for budget, topk in [(8, 2), (3, 1)]:
        params = LiveParams(budget=budget, topk=topk)
        alone = [
            ref.generate(p, SamplingParams(max_tokens=n), params).output
            for p, n in zip(PROMPTS[:3], LENGTHS[:3], strict=True)
        ]
        sampling = [SamplingParams(max_tokens=n) for n in LENGTHS[:3]]
        assert run_lockstep(eng, PROMPTS[:3], sampling, params, join_late={2}) == alone


def test_kv_slots_fit_the_memory_fraction():
    """The pool gets at most --max-batch slots, as many as fit in what is free less the
    (1 - fraction) of the device kept for everything else; not even one is a config error
    naming the two settings to change (CUDA only: the engine asks torch.cuda.mem_get_info)."""
    from ddserve.engine.static import fit_slots
    from ddserve.errors import ConfigError

    gib = 1 << 30
    assert fit_slots(64, gib, free=100 * gib, total=140 * gib, fraction=0.9) == 64
    assert fit_slots(128, gib, free=100 * gib, total=140 * gib, fraction=0.9) == 86
    assert fit_slots(128, gib, free=100 * gib, total=140 * gib, fraction=0.5) == 30
    with pytest.raises(ConfigError, match="lower --max-context or raise --gpu-memory"):
        fit_slots(8, 2 * gib, free=15 * gib, total=140 * gib, fraction=0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="tiny-random", gpu_memory_utilization=1.5)
    # the per-slot size the engine asks for is what a pool of that shape takes
    from ddserve.engine.static import KVPool

    cfg = tiny_config(vocab_size=512)
    pool = KVPool(cfg, cfg.num_layers, 3, 640, 512, "cpu", torch.float32)
    per_slot = KVPool.slot_bytes(cfg, cfg.num_layers, 640, torch.float32)
    assert 3 * per_slot == pool.k.nbytes + pool.v.nbytes


def test_pool_moves_copy_every_layers_keys_and_values_of_the_entries_named():
    """`KVPool.move` (a round's accepted paths: entries gathered, then written, dst <= src)
    copies keys and values of every layer and KV head of exactly the entries named, in their
    own slots, as a copy entry by entry from a snapshot does; the keys and values are one
    buffer (k = kv[0], v = kv[1])."""
    from ddserve.engine.static import KVPool

    cfg = tiny_config(vocab_size=512)
    pool = KVPool(cfg, cfg.num_layers, 3, 64, 16, "cpu", torch.float32)
    assert pool.k.data_ptr() == pool.kv[0].data_ptr() and pool.v.data_ptr() == pool.kv[1].data_ptr()
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(2)))
    slots, dst, src = (
        [2, 2, 2, 0, 1],
        [10, 11, 12, 5, 40],
        [11, 14, 12, 9, 47],
    )  # 11: read, then written
    want = pool.kv.clone()
    for s, d, r in zip(slots, dst, src, strict=True):
        want[:, :, s, :, d] = pool.kv[:, :, s, :, r]
    pool.move(slots, dst, src)
    assert torch.equal(pool.kv, want)
    # 10 took 11's old entry, not 14's (which 11 took): a chain of copies would differ
    assert not torch.equal(want[:, :, 2, :, 10], want[:, :, 2, :, 11])


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash"])
def test_the_warm_up_captures_every_graph_serving_can_need(tiny, monkeypatch, drafter):
    """With triton the context classes are two, up to 512 keys and the pool's length (the
    class only bounds the kernel's key splits): every context falls in one, and the warm-up
    captures each batch bucket x verify width x class, each draft shape x class, and each
    prompt chunk x rows x class that holds it, so no forward while serving captures (and
    compiles) a graph while the running requests wait; trees built on the host (n-gram)
    vary in size: every power-of-two width up to their bound; and a prompt's first chunk of
    every fresh width and row count (the fresh class). With sdpa (it reads the padded
    range) the classes are powers of two, those of the warm-up's contexts captured."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the engine's choice only: nothing runs
    make = {
        "none": NoDrafter,
        "ngram": lambda: NGramDrafter(512),
        "dflash": lambda: DFlashDrafter(random_dflash(tiny), tiny),
    }
    eng = StaticEngine(
        tiny, make[drafter](), 6, (), slots=8, max_context=4096, graphs=False,
        attention="triton", device_tree=False,
    )  # fmt: skip
    t, ml = eng.target, eng.target.pool.max_len
    eng.fresh_chunks = fresh_chunks(ml, t.pool.usable)  # as under graphs
    assert eng.fresh_chunks == (1024, 2048, 3072, 4096)  # the pool's 4,096 + guard
    wide = (4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192)
    assert fresh_chunks(8192 + 512, 8192)[3:] == wide
    assert fresh_chunks(8192 + 512, 7000)[-1] == 7168 and fresh_chunks(5000)[-1] == 4608
    assert t.classes((128, 256, 512)) == [512, ml]
    assert {t.ctx_bucket(n) for n in range(1, ml + 1)} == {512, ml}
    keys = set()
    t.graphs.enabled = True  # record the shapes, capture nothing (no GPU here)
    t.forward = lambda packed, b, w, ctx, slots, trees=None: keys.add((slots, b, w, ctx))
    if eng.sdraft is not None:
        eng.sdraft.forward = lambda packed, key: keys.add(("draft", *key))
        eng.sdraft.write_only = lambda cwpos: None
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    params = LiveParams(budget=6, topk=2)
    eng.warm_up(params)
    width = eng.tree_width(6, 2)[0]
    # AR verifies roots alone (a width of 1); a tree built on the host (n-gram, and DFlash
    # here, with device_tree off) is any power of two up to its bound, a round without a
    # draft the root alone
    widths = {1} if drafter == "none" else {1, 2, 4, 8}
    assert width == 8
    for ctx in (512, ml):
        for b in (1, 2, 4, 8):
            assert {k for k in keys if k[:2] == (True, b) and k[3] == ctx} == {
                (True, b, w, ctx) for w in widths
            }
            if eng.sdraft is not None:
                assert any(k[:2] == ("draft", b) and k[3] == ctx for k in keys)
            for w in eng.chunks:
                assert ((False, b, w, ctx) in keys) == (w <= ctx)
    # a prompt's first chunk: every fresh width, rows up to FRESH_TOKENS in powers of two
    assert {k for k in keys if k[3] == FRESH_CTX and k[0] is False} == {
        (False, b, w, FRESH_CTX)
        for w in eng.fresh_chunks
        for b in (1, 2, 4, 8)
        if b <= fresh_rows(w)
    }
    assert fresh_rows(3072) == 4 and fresh_rows(8192) == 2 and fresh_rows(1024) == 8
    # (slots, b, w, ctx) / ("draft", b, depth, ctx, ...)
    assert {k[3] for k in keys} == {512, ml, FRESH_CTX}
    sdpa = StaticEngine(tiny, NoDrafter(), 6, (), slots=8, max_context=4096, graphs=False)
    assert sdpa.target.classes((128, 256, 512)) == [128, 256, 512]
    assert sdpa.target.ctx_bucket(513) == 1024


def test_compiled_glue_that_fails_runs_eagerly(monkeypatch, caplog):
    """A compiler failure at the glue's first call (the warm-up) is logged and the glue runs
    eagerly from then on: the same result, the engine up."""
    from ddserve.engine import static_models

    calls = []

    def broken(fn, **kwargs):
        def run(*args):
            calls.append("compiled")
            raise RuntimeError("inductor could not lower this")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    glue = static_models.glue_compiled(lambda x: x * 2, True)
    assert glue(torch.ones(2)).tolist() == [2.0, 2.0]
    assert glue(torch.ones(2)).tolist() == [2.0, 2.0]
    assert calls == ["compiled"]  # tried once, then eager
    assert "runs eagerly" in caplog.text
    monkeypatch.setattr(static_models, "COMPILE_GLUE", False)
    plain = lambda x: x  # noqa: E731
    assert static_models.glue_compiled(plain, True) is plain


@cuda
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_budgets_changing_round_by_round_stay_finite_cuda_bf16(batch, steps):
    """What adaptive speculation does on a GPU: the budget changing round by round (verify
    widths 16, 8, 4, 2, 1) and fixed small budgets, one and two requests a round, in bf16
    on SmolLM2's shapes (random weights) with the builtin DFlash drafter, as served (CUDA
    graphs, fused layers, triton attention, trees on the GPU; one round a call, and four:
    rounds a trip, budget 0 in plain steps): no request ends with
    non-finite logits. On an H100 the adaptive runner's requests did, with the real weights,
    where fixed b15/k4 ones did not (bench/NOTES.md, twenty-eighth session;
    ddserve.bench.nonfinite_probe takes the suspects out one at a time)."""
    from ddserve.bench.engine_cpu import make_drafter
    from ddserve.bench.nonfinite_probe import SCHEDULES, run
    from ddserve.bench.round_profile import random_smollm2

    lm, prompts, _ = random_smollm2("cuda")
    m = lm.model
    eng = StaticEngine(
        m,
        make_drafter("dflash", m, None),
        8,
        (),
        slots=2,
        max_context=1024,
        graphs=True,
        scheduler_steps=steps,
    )
    assert eng.device_tree and eng.fused_layers and eng.target.attention == "triton"
    for name, schedule in SCHEDULES.items():
        row = run(eng, prompts[:4], schedule, 48, batch)
        assert row["failed"] == 0, (name, row)


@cuda
def test_split_k_counters_stay_zero_whatever_graph_replays_cuda_bf16():
    """The split-K kernels' tile counters (ddserve.engine.layer_split) are zero between
    kernels, whichever captured forward replays, in any order: made outside every capture
    (GraphCache's warm-up run on the capture stream), no graph's scratch overlaps them. Made
    inside one, they came from the lane's shared graph pool, where forwards captured earlier
    overwrote them at each replay (the H100's adaptive rounds: non-finite logits)."""
    from ddserve.bench.engine_cpu import make_drafter
    from ddserve.bench.round_profile import random_smollm2
    from ddserve.engine import layer_split

    layer_split._SPACES.clear()  # this engine's workspaces only
    made = len(layer_split._KEEP)
    lm, _, _ = random_smollm2("cuda")
    m = lm.model
    eng = StaticEngine(
        m, make_drafter("dflash", m, None), 8, (), slots=2, max_context=1024, graphs=True
    )
    for budget in (0, 1, 3, 7, 15):  # the shapes adaptive speculation's rounds take
        eng.warm_up(LiveParams(budget=budget, topk=4))
    counters = [cnt for _, cnt in layer_split._KEEP[made:]]  # replaced ones too
    assert counters, "no split-K kernel ran"
    graphs = [*eng.target.graphs.graphs.items(), *eng.sdraft.graphs.graphs.items()]
    assert len(graphs) > 10
    for order in (graphs, graphs[::-1]):
        for key, (graph, _) in order:  # the warm-up's inputs: guard entries only
            graph.replay()
            torch.cuda.synchronize()
            assert all(int(c.count_nonzero()) == 0 for c in counters), key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_newcomers_catch_up_in_one_write_as_one_by_one(tiny, device, monkeypatch):
    """Several prompts' drafter context in one write (`StaticDFlash.extend_many`: one
    projection, one indexed write of rows padded to a power of two) leaves the pool as one
    `extend` each would, and touches nothing else but the first slot's last (guard) entry
    (the pool starts random, so a stray write shows); past CATCH_UP_GRAPH_ROWS rows, one
    `extend` each. On CUDA: graphs on (the write runs as its size's graph over the shared
    feature buffer)."""
    from ddserve.engine import static_dflash

    model = tiny if device == "cpu" else random_llama(tiny_config(vocab_size=512), seed=3).cuda()
    eng = StaticEngine(
        model, DFlashDrafter(random_dflash(model), model), 6, (), slots=4, max_context=256,
        graphs=device == "cuda",
    )  # fmt: skip
    sd = eng.sdraft
    ml = sd.pool.max_len
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(sd.pool.kv.shape, generator=gen).to(sd.pool.kv)
    width = sd.feats.shape[-1]
    taps = [torch.randn(n, width, generator=gen).to(sd.feats) for n in (37, 2, 90)]  # 256 rows
    slots, starts = [3, 0, 1], [0, 12, 4]
    sd.pool.kv.copy_(start)
    for slot, at, t in zip(slots, starts, taps, strict=True):
        sd.extend(slot, at, t)
    one_by_one = sd.pool.kv.clone()
    extends = []
    monkeypatch.setattr(sd, "extend", lambda *a: (extends.append(a), type(sd).extend(sd, *a)))
    for limit, calls in ((static_dflash.CATCH_UP_GRAPH_ROWS, 0), (128, 3)):
        monkeypatch.setattr(static_dflash, "CATCH_UP_GRAPH_ROWS", limit)
        sd.pool.kv.copy_(start)
        extends.clear()
        sd.extend_many(slots, starts, taps)
        assert len(extends) == calls  # padded rows in one write, or past the limit one each
        kv = sd.pool.kv
        guard = torch.zeros(kv.shape[:5], dtype=torch.bool, device=kv.device)
        guard[:, :, 3, :, ml - 1] = calls == 0  # the padding's entry, only with padding
        diff = (one_by_one - kv).abs().amax(-1)
        assert diff[~guard].max() < 1e-5, limit
    if device == "cuda":  # the write of 256 rows ran as its graph (a failed capture: eager)
        assert sd.graphs.enabled and ("catch_up", 256) in sd.graphs.graphs
    assert (one_by_one - start)[:, :, 1, :, 4:94].abs().amin() > 0  # written where asked
    assert torch.equal(one_by_one[:, :, 2], start[:, :, 2])  # the slot no prompt took


def test_a_cpu_pool_takes_memory_for_the_entries_written():
    """A CPU KV pool sized for 8,192 entries a slot takes memory as entries are written: a
    few entries in every slot cost kilobytes, not each slot's whole context (where
    transparent huge pages are on, numpy's zeros had each (layer, slot, head) row of 2 MB
    committed whole by its first entry: 32 short requests took 12 GB)."""
    from ddserve.bench.static_step import SMOLLM2 as cfg  # 30 layers, 3 kv heads of 64
    from ddserve.engine.static import KVPool

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    pool = KVPool(cfg, cfg.num_layers, 4, 8192, 512, "cpu", torch.float32)
    assert pool.kv.nbytes == 4 * KVPool.slot_bytes(cfg, 30, 8192, torch.float32)  # 1.4 GiB
    pool.kv[:, :, :, :, :16] = 1.0  # 16 entries of every slot, layer and head
    assert torch.equal(pool.kv[1, 29, 3, 2, 15], torch.ones(64))
    assert float(pool.kv[0, 0, 0, 0, 16:].abs().sum()) == 0.0
    assert rss() - before < 64 * 2**20, (rss() - before) / 2**20
    # a private mapping (as calloc's), not shared memory a forked process would write into
    addr = pool.kv.data_ptr()
    with open("/proc/self/maps") as f:
        perms = [
            ln.split()[1]
            for ln in f
            if int(ln.split("-")[0], 16) <= addr < int(ln.split()[0].split("-")[1], 16)
        ]
    assert perms == ["rw-p"], perms
