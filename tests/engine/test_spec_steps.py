"""Several DDTree rounds a host round trip (ddserve.engine.static_spec, `--num-scheduler-steps`
with a DFlash drafter whose trees the device builds): the accept on the device is the host
walk's, path for path; greedy answers are the reference's token for token with the same
accept lengths, alone and in batches with late joiners, at every budget shape, up to the
context's end and stopping inside the rounds; seeded samples draw as one-round rounds do and
follow the target's distribution; log-probs and budget-0 rounds take one round; non-finite
logits end the request with nothing committed. Off CUDA the trees come from the host oracle
of the tree kernel (test_tree_triton); the CUDA tests (graphs, fp32) run on a GPU machine
(the device tool), not in CI."""

import numpy as np
import pytest
import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.sequence import tokens_before
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.tree import accept_batch, accept_device, ancestor_mask, build_tree_top
from ddserve.engine.weights import random_llama, tiny_config
from ddserve.errors import EngineError
from tests.engine.reference import ReferenceDFlash, ReferenceEngine, runner_together_and_alone
from tests.engine.test_batching import PROMPTS, check_batched_sampling, run_lockstep
from tests.engine.test_lossless import random_dflash
from tests.engine.test_tree_triton import host_build_trees

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
LENGTHS = [30, 12, 25, 40, 5]


@pytest.fixture(autouse=True)
def oracle_kernel(monkeypatch):
    if not CUDA:
        from ddserve.engine import tree_triton

        monkeypatch.setattr(tree_triton, "build_trees", host_build_trees)


def models(vocab: int, device: str = "cpu", dtype=torch.float32):
    """A target and its untrained DFlash drafter; a small vocabulary makes the drafter
    right often (paths of up to 6 nodes at vocab 8), a larger one rarely."""
    target = random_llama(tiny_config(vocab_size=vocab), seed=3).to(device, dtype)
    return target, random_dflash(target).to(device, dtype)


def prompts(vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in PROMPTS]


def engine(target, draft, steps: int, eos=(), slots=8, max_context=256) -> StaticEngine:
    eng = StaticEngine(
        target,
        DFlashDrafter(draft, target),
        6,
        eos,
        slots=slots,
        max_context=max_context,
        graphs=target.device.type == "cuda",
        device_tree=True,
        scheduler_steps=steps,
    )
    eng.rounds_on_device = 0  # draft forwards the device packed (rounds past a call's first)
    again = eng.sdraft.again

    def counted():
        eng.rounds_on_device += 1
        return again()

    eng.sdraft.again = counted
    eng.paths = []  # every round's accepted path, call by call (adaptive speculation's samples)
    step = eng.step

    def step_paths(seq, params):
        out = step(seq, params)
        eng.paths.extend(seq.last_paths)
        return out

    eng.step = step_paths
    return eng


def random_trees(rng, b: int, w: int, vocab: int):
    toks = np.zeros((b, w), np.int64)
    par = np.full((b, w), -2, np.int64)
    mask = np.zeros((b, w, w), np.int64)
    for i in range(b):
        depth, k = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        lp = np.sort(rng.normal(size=(depth, k)), axis=1)[:, ::-1].tolist()
        # sometimes a token twice among a depth's candidates: the first child counts
        ids = [rng.choice(vocab, size=k, replace=bool(rng.random() < 0.3)).tolist() for _ in lp]
        tree = build_tree_top(int(rng.integers(vocab)), lp, ids, int(rng.integers(0, w)))
        toks[i, : tree.size], par[i, : tree.size] = tree.tokens, tree.parents
        mask[i] = ancestor_mask(tree, w)
    return toks, par, mask


def test_accept_on_the_device_is_the_host_walk():
    rng = np.random.default_rng(0)
    longest = 0
    for _ in range(300):
        b, w, vocab = int(rng.integers(1, 6)), int(rng.choice([8, 16])), 4
        toks, par, mask = random_trees(rng, b, w, vocab)
        targets = rng.integers(0, vocab, size=(b, w))
        paths, lengths, bonus, _ = accept_batch(toks, par, targets)
        keep, got, bon = accept_device(*(torch.from_numpy(x) for x in (toks, par, mask, targets)))
        assert got.tolist() == lengths.tolist() and bon.tolist() == bonus.tolist()
        for i, n in enumerate(lengths.tolist()):
            assert keep[i, 1 : n + 1].tolist() == paths[i, :n].tolist()
            assert keep[i, 0] == 0 and keep[i, n + 1 :].tolist() == list(range(n + 1, w))
        longest = max(longest, int(lengths.max()))
    assert longest >= 4  # deep paths were walked, not only roots


def check_greedy(device: str, dtype):
    for vocab, shapes in [(8, [(16, 4, 2048), (8, 1, 2048), (3, 2, 4)]), (512, [(16, 4, 4)])]:
        target, draft = models(vocab, device, dtype)
        ps = prompts(vocab)
        for budget, topk, window in shapes:
            params = LiveParams(budget=budget, topk=topk, window=window)
            ref = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
            sp = [SamplingParams(max_tokens=n) for n in LENGTHS]
            alone = [ref.generate(p, s, params) for p, s in zip(ps, sp, strict=True)]
            one = engine(target, draft, 1)  # one round a call: the nodes its trees drafted
            drafted = [
                one.generate(p, s, params).stats.draft_tokens for p, s in zip(ps, sp, strict=True)
            ]
            assert len(one.paths) == sum(len(s.stats.accept_lengths) for s in alone)
            for steps in (2, 3, 8):
                label = f"vocab={vocab} budget={budget} topk={topk} steps={steps}"
                eng = engine(target, draft, steps)
                mine = [eng.generate(p, s, params) for p, s in zip(ps, sp, strict=True)]
                assert [s.output for s in mine] == [s.output for s in alone], label
                assert [s.stats.accept_lengths for s in mine] == [
                    s.stats.accept_lengths for s in alone
                ], label
                assert [s.stats.draft_tokens for s in mine] == drafted, label
                assert eng.paths == one.paths, label  # each round's path, not a call's last
                assert eng.rounds_on_device > 0, label
                together = run_lockstep(eng, ps, sp, params, join_late={2, 4})
                assert together == [s.output for s in alone], label
                assert eng.free_slots == 8
        if vocab == 8:  # paths of several nodes were accepted and moved
            assert max(max(s.stats.accept_lengths) for s in alone) >= 4


def test_greedy_rounds_equal_the_reference_cpu():
    check_greedy("cpu", torch.float32)


@cuda
def test_greedy_rounds_equal_the_reference_cuda_graphs_fp32():
    check_greedy("cuda", torch.float32)


def test_rounds_up_to_the_context_end():
    """A slot of 64 entries: the rounds that fit run on the device, the last ones one at a
    time; the answer is the reference's up to the context's end."""
    target, draft = models(8)
    params = LiveParams(budget=16, topk=4)
    ref = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
    eng = engine(target, draft, 8, max_context=64)
    for prompt in prompts(8)[:3]:
        sp = SamplingParams(max_tokens=64 - len(prompt))
        want = ref.generate(prompt, sp, params)
        got = eng.generate(prompt, sp, params)
        assert got.output == want.output and got.stats.accept_lengths == want.stats.accept_lengths
    assert eng.rounds_on_device > 0


def test_a_stop_inside_the_rounds_ends_the_answer_there():
    target, draft = models(8)
    params = LiveParams(budget=16, topk=4)
    base = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ()).generate(
        prompts(8)[0], SamplingParams(max_tokens=40), params
    )
    eos = base.output[9]
    want = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, (eos,)).generate(
        prompts(8)[0], SamplingParams(max_tokens=40), params
    )
    eng = engine(target, draft, 8, eos=(eos,))
    seq = eng.generate(prompts(8)[0], SamplingParams(max_tokens=40), params)
    assert seq.output == want.output and seq.finish_reason == "stop"
    assert seq.stats.accept_lengths == want.stats.accept_lengths
    # the slot's next request decodes as if the rounds had stopped at the EOS
    again = eng.generate(prompts(8)[1], SamplingParams(max_tokens=20), params)
    plain = engine(target, draft, 1, eos=(eos,)).generate(
        prompts(8)[1], SamplingParams(max_tokens=20), params
    )
    assert again.output == plain.output


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_seeded_samples_draw_as_one_round_does(device):
    """Sampled requests (temperature, top-k, top-p, a logit bias, seeds) beside greedy ones,
    one with a bias: every token as in one-round rounds."""
    target, draft = models(8, device)
    bias = ((5, 3.0), (2, -100.0))
    sampling = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1),
        SamplingParams(max_tokens=19),
        SamplingParams(max_tokens=21, temperature=0.7, top_k=5, top_p=0.9, seed=2),
        SamplingParams(max_tokens=23, temperature=1.3, seed=3, logit_bias=bias),
        SamplingParams(max_tokens=20, logit_bias=bias),
    ]
    params = LiveParams(budget=16, topk=4)
    outs = []
    for steps in (1, 4):
        eng = engine(target, draft, steps)
        outs.append(run_lockstep(eng, prompts(8), sampling, params, join_late={2}))
    assert outs[0] == outs[1]
    assert eng.rounds_on_device > 0
    assert 2 not in outs[1][3] and 2 not in outs[1][4]  # the bias holds in every round


def test_sampling_follows_the_target_distribution():
    """T=1 in rounds of two (two tokens an answer): pair frequencies match exact
    enumeration."""
    check_batched_sampling(
        lambda target, _: engine(target, random_dflash(target), 2, max_context=64),
        n=800,
        tv=0.09,
    )


def test_logprobs_take_one_round_budgets_may_change_between_calls():
    """Requests with log-probs run one round a call; budgets changing call by call
    (adaptive speculation, budget-0 calls between drafts) keep the reference's answer."""
    target, draft = models(8)
    sampling = [SamplingParams(max_tokens=30, logprobs=2), SamplingParams(max_tokens=30)]
    eng = engine(target, draft, 4)
    seq = eng.generate(prompts(8)[0], sampling[0], LiveParams(budget=16, topk=4))
    assert eng.rounds_on_device == 0 and len(seq.logprobs) == len(seq.output)
    ref = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
    outs = []
    for e in (ref, eng):
        s = e.new_sequence(prompts(8)[1], sampling[1])
        e.prefill(s)
        for budget in [8, 0, 0, 3, 0, 16, 1, 0, 7] * 4:
            if not s.finished:
                e.step_batch([s], LiveParams(budget=budget, topk=2))
        outs.append(s)
    # a call of budget > 0 runs several rounds there, one here: other trees, the same answer
    assert outs[1].output == outs[0].output
    assert eng.rounds_on_device > 0


@pytest.mark.parametrize(
    "device,buffered",
    [
        ("cpu", 0),
        ("cpu", 32),
        pytest.param("cuda", 0, marks=cuda),
        pytest.param("cuda", 32, marks=cuda),
    ],
)
def test_budget_zero_calls_take_plain_steps_and_feed_the_drafter(device, buffered, monkeypatch):
    """Budget-0 calls (adaptive speculation at a large batch, spec_max_batch) run several
    plain steps with a DFlash drafter too. Each step's tapped row reaches the drafter's
    context (buffered, written before a call its rows would not hold, or before a draft
    whose context write would not take them: a one-round draft or rounds a trip on the
    device), so the drafts after them are those after as many one-step budget-0 calls and
    the reference engine's: the same answers and accept lengths (and, against one-step
    calls, drafted nodes), for three requests in one batch (on a GPU under CUDA graphs)."""
    from ddserve.engine import static_dflash

    monkeypatch.setattr(static_dflash, "BUFFERED_ROWS", buffered)
    target, draft = models(8, device)
    ps, sp = prompts(8)[:3], [SamplingParams(max_tokens=n) for n in (110, 85, 98)]
    # (budget, steps) a call; a slot buffers a draft's 7 feature rows (block 6 + 1) or 32
    schedule = [(0, 4), (16, 1), (0, 7), (0, 3), (16, 3), (0, 6), (0, 2), (16, 1), (0, 5)]
    schedule += [(16, 1), *[(0, 7)] * 6, (16, 3), (0, 3)]  # 42 rows: 32 fill up
    schedule += [(16, 3), (0, 3)] * 8 + [(16, 1)] * 40
    runs, contexts = [], []
    for mode in ("one", "multi", "reference"):
        multi = mode == "multi"
        if mode == "reference":  # one round a call, drafts of its own (ReferenceDFlash)
            eng = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
        else:
            eng = engine(target, draft, 1)
        seqs = [eng.new_sequence(p, s) for p, s in zip(ps, sp, strict=True)]
        for seq in seqs:
            eng.prefill(seq)
        most = 1
        for budget, steps in schedule:
            params = LiveParams(budget=budget, topk=4)
            for _ in range(1 if multi else steps):
                if live := [seq for seq in seqs if not seq.finished]:
                    if mode == "reference":
                        out = eng.step_batch(live, params)
                    else:
                        out = eng.step_batch(live, params, steps if multi else 1)
                        most = max(most, eng.round_steps)
                    assert not any(isinstance(o, Exception) for o in out)
        assert all(seq.finished for seq in seqs)
        runs.append(seqs)
        if mode != "reference":
            assert (most > 1) == multi and eng.free_slots == 8 - 3
            # the drafter's context as written (rounds a trip write theirs on the device)
            kv = eng.sdraft.pool.kv
            contexts.append([kv[:, :, s.cache.slot, :, : s.draft_state].cpu() for s in seqs])
    ref = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
    want = [ref.generate(p, s, LiveParams(budget=0)).output for p, s in zip(ps, sp, strict=True)]
    one, multi, reference = runs
    assert [s.output for s in multi] == [s.output for s in one] == want
    lengths = [s.stats.accept_lengths for s in one]
    assert [s.stats.accept_lengths for s in multi] == lengths
    assert [s.stats.accept_lengths for s in reference] == lengths  # every draft saw it all
    assert [s.stats.draft_tokens for s in multi] == [s.stats.draft_tokens for s in one]
    assert max(max(s.stats.accept_lengths) for s in one) >= 3  # the drafts were right often
    for a, b in zip(*contexts, strict=True):  # every position's context entry, alike
        n = min(a.shape[-2], b.shape[-2])
        assert n > 60 and (a[..., :n, :] - b[..., :n, :]).abs().max() < 1e-4


def test_non_finite_logits_end_the_request_with_nothing_committed():
    target, draft = models(8)
    with torch.no_grad():
        target.lm_head.weight[3] = float("nan")
    eng = engine(target, draft, 4)
    seq = eng.new_sequence(prompts(8)[0], SamplingParams(max_tokens=20))
    eng.prefill(seq)
    length = seq.cache.length
    (out,) = eng.step_batch([seq], LiveParams(budget=16, topk=4))
    assert isinstance(out, EngineError) and "non-finite" in str(out)
    assert seq.output == [] and seq.cache.length == length and seq.finish_reason == "error"


def test_the_warm_up_round_touches_no_request():
    """The glue graphs' warm-up (spec_warm_up: a round with no request in any row) between a
    request's rounds, with its KV and feature rows in place: its answer stays the
    reference's."""

    target, draft = models(8)
    params = LiveParams(budget=16, topk=4)
    sp = SamplingParams(max_tokens=40)
    want = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ()).generate(
        prompts(8)[0], sp, params
    )
    eng = engine(target, draft, 4)
    seq = eng.new_sequence(prompts(8)[0], sp)
    eng.prefill(seq)
    depth = eng.block_depth(params.budget)
    w = eng.tree_width(params.budget, params.topk)[0]
    while not seq.finished:
        eng.step_batch([seq], params)
        for b in (1, 2):  # what warm_up runs for each draft shape
            key = (b, depth, 256, params.topk, params.budget, w)
            drafted = eng.sdraft.forward(eng.sdraft.guard_inputs(b, depth), key)
            eng.spec_warm_up(drafted, key, [128, 256], params.window)
    assert seq.output == want.output and seq.stats.accept_lengths == want.stats.accept_lengths
    assert eng.rounds_on_device > 0


def test_round_times_time_one_round_a_call():
    """Adaptive speculation's start-up costs (round_times) are per round, whatever rounds a
    call of the engine would run."""
    target, draft = models(8)
    eng = engine(target, draft, 8)
    times = eng.round_times(LiveParams(budget=16, topk=4), [0, 16], rounds=2)
    assert times and eng.rounds_on_device == 0


@pytest.mark.parametrize("share,beside", [(0.0, False), (0.5, True)])
def test_runner_rounds_a_trip_serve_concurrent_requests_as_alone(
    tmp_path, monkeypatch, share, beside
):
    """Through the runner (num_scheduler_steps=4, a DFlash drafter, trees built by the
    kernel's host oracle as on a GPU): concurrent requests get their answers alone; calls
    with prompts joining or a first token to make run one round, the others four. With
    --first-token-share 0.5 and rounds.JOIN_BESIDE_TRIP, a prompt just in (or joining) runs
    its first rounds inside a trip of the others' four: still its answer alone."""
    from ddserve.config.engine import EngineConfig
    from ddserve.engine import rounds as rounds_mod
    from ddserve.engine.dflash import save_dflash
    from ddserve.engine.runner import EngineRunner

    monkeypatch.setattr(rounds_mod, "JOIN_BESIDE_TRIP", beside)
    save_dflash(random_dflash(random_llama(tiny_config(), 0)), tmp_path / "dd")
    cfg = EngineConfig(
        first_token_share=share,
        model="tiny-random",
        device="cpu",
        max_batch=4,
        num_scheduler_steps=4,
        drafter={"kind": "dflash", "dflash_path": str(tmp_path / "dd")},
        params={"budget": 8, "topk": 2},
    )
    runner = EngineRunner(cfg)
    runner.start()
    asked, rounds = [], []
    try:
        eng = runner.engine
        eng.device_tree = True  # the rounds a trip need the trees on the device (the oracle)
        step_batch, again = eng.step_batch, eng.sdraft.again

        def spy(seqs, params, steps=None):
            asked.append(steps)
            return step_batch(seqs, params, steps)

        monkeypatch.setattr(eng, "step_batch", spy)
        monkeypatch.setattr(eng.sdraft, "again", lambda: (rounds.append(1), again())[1])

        together, alone = runner_together_and_alone(runner, 6, 24)
    finally:
        runner.shutdown()
    assert together == alone and all(len(o) == 24 for o in together)
    assert 1 in asked and 4 in asked and rounds


def test_a_non_finite_round_after_others_ends_the_request_after_their_tokens():
    """A call of four rounds whose third has non-finite logits in one request's rows: that
    request ends with the first two rounds' tokens committed (the reference's first tokens),
    which the error carries for delivery before it; the request beside it is untouched."""
    target, draft = models(8)
    eng = engine(target, draft, 4)
    ps, sp = prompts(8)[:2], SamplingParams(max_tokens=40)
    seqs = [eng.new_sequence(p, sp) for p in ps]
    for seq in seqs:
        eng.prefill(seq)
    replay, calls, slot = eng.target.replay, [], seqs[0].cache.slot

    def poisoned(key):
        logits, top, taps = replay(key)
        calls.append(key)
        if len(calls) == 3:  # the call's third round: the first request's rows not finite
            w = key[2]
            top = top.clone()
            top[1, slot * w : (slot + 1) * w] = 0
        return logits, top, taps

    eng.target.replay = poisoned
    params = LiveParams(budget=16, topk=4)
    bad, good = eng.step_batch(seqs, params)
    eng.target.replay = replay
    assert eng.round_steps == 4 and len(calls) == 4
    assert isinstance(bad, EngineError) and "non-finite" in str(bad)
    assert tokens_before(bad) == seqs[0].output and len(seqs[0].output) >= 2
    assert seqs[0].finish_reason == "error" and seqs[0].stats.verify_rounds == 2
    eng.release(seqs[0])
    while not seqs[1].finished:
        (out,) = eng.step_batch([seqs[1]], params)
        assert not isinstance(out, Exception)
    ref = ReferenceEngine(target, ReferenceDFlash(draft, target), 6, ())
    want = [ref.generate(p, sp, LiveParams(budget=0)).output for p in ps]
    assert seqs[0].output == want[0][: len(seqs[0].output)] and seqs[1].output == want[1]
