"""The GPU tree build (ddserve.engine.tree_triton) equals the host's best-first heap
(`build_tree_top`) node for node: tokens, parents, depths, weights and the ancestor mask, on
random drafts of many shapes, with ties (the heap's insertion order breaks them) and with
-inf candidates (skipped); padding rows are inert. Without a GPU the kernel runs in triton's
interpreter, as the attention kernel's tests do."""

import numpy as np
import pytest
import torch

from tests.engine.triton_interpreter import (
    CUDA,
    DEV,
    interpreted,
    interpreter,  # noqa: F401  (autouse fixture)
)

with interpreted():
    from ddserve.engine.static import next_bucket
    from ddserve.engine.tree import Tree, ancestor_mask, build_tree_top, size_bound
    from ddserve.engine.tree_triton import build_trees


def random_drafts(rng, b, depth, kk, *, ties=False, holes=False):
    """[B, D, K] log-probs sorted descending per depth and distinct token ids per depth."""
    if ties:  # few distinct values: many equal path weights
        lp = np.log(rng.choice([0.5, 0.25, 0.125], size=(b, depth, kk)))
    else:
        lp = np.log(rng.dirichlet(np.ones(64), size=(b, depth))[..., :kk])
    lp = -np.sort(-lp, axis=-1)
    if holes:  # a depth may have fewer candidates than k
        cut = rng.integers(1, kk + 1, size=(b, depth))
        lp[np.arange(kk)[None, None, :] >= cut[..., None]] = -np.inf
    ids = np.stack(
        [[rng.choice(1000, size=kk, replace=False) for _ in range(depth)] for _ in range(b)]
    )
    return lp, ids


def host_build_trees(top_lp, top_ids, root, lens, budget, k, width):
    """`build_trees`' contract through the host heap (the oracle): the same tensors."""
    b = top_lp.shape[0]
    tok = torch.zeros(b, width, dtype=torch.int64)
    par = torch.full((b, width), -2, dtype=torch.int64)
    logw = torch.zeros(b, width, dtype=torch.float64)
    pos = lens.cpu()[:, None].repeat(1, width)
    mask = torch.zeros(b, width, width, dtype=torch.int64)
    for r in range(b):
        lp, ids = top_lp[r, :, :k].tolist(), top_ids[r, :, :k].tolist()
        t = build_tree_top(int(root[r]), lp, ids, budget)
        n = t.size
        tok[r, :n], par[r, :n], logw[r, :n] = (
            torch.tensor(x) for x in (t.tokens, t.parents, t.node_logws)
        )
        pos[r, :n] += torch.tensor(t.depths)
        mask[r] = torch.from_numpy(ancestor_mask(t, width))
    return tuple(x.to(top_lp.device) for x in (tok, pos, par, logw, mask))


def check(lp, ids, budget, k, lens):
    b, depth, _ = lp.shape
    width = next_bucket(size_bound(budget, depth, k) + 1, 2, 1 << 30)
    root = torch.arange(7, 7 + b)
    out = build_trees(
        torch.tensor(lp, dtype=torch.float64, device=DEV),
        torch.tensor(ids, dtype=torch.int64, device=DEV),
        root.to(DEV),
        torch.tensor(lens, device=DEV),
        budget,
        k,
        width,
    )
    tok, pos, par, logw, mask = (t.cpu().numpy() for t in out)
    for r in range(b):
        want = build_tree_top(int(root[r]), lp[r, :, :k].tolist(), ids[r, :, :k].tolist(), budget)
        got = Tree.from_parents(tok[r].tolist(), par[r].tolist(), logw[r].tolist())
        n = want.size
        assert got.tokens == want.tokens, (r, budget, k)
        assert got.parents == want.parents and got.depths == want.depths
        assert got.node_logws == want.node_logws  # float64, same order of additions
        assert got.first_child == want.first_child and got.next_sibling == want.next_sibling
        assert (pos[r, :n] == lens[r] + np.asarray(want.depths)).all()
        assert (mask[r].astype(bool) == ancestor_mask(want, width)).all()
        assert (tok[r, n:] == 0).all() and (par[r, n:] == -2).all()  # padding rows


@pytest.mark.parametrize(
    "budget,depth,k",
    [(1, 1, 1), (3, 4, 1), (8, 8, 1), (8, 8, 2), (16, 8, 4), (16, 3, 2), (31, 6, 4), (40, 2, 8)],
)
def test_equals_host_build_on_random_drafts(budget, depth, k):
    rng = np.random.default_rng(budget * 100 + depth * 10 + k)
    lp, ids = random_drafts(rng, 3, depth, max(k, 4))
    check(lp, ids, budget, k, [0, 5, 123])


@pytest.mark.parametrize("budget,depth,k", [(16, 8, 4), (7, 3, 3)])
def test_ties_break_in_the_heap_order(budget, depth, k):
    rng = np.random.default_rng(1)
    lp, ids = random_drafts(rng, 4, depth, k, ties=True)
    check(lp, ids, budget, k, [0, 1, 2, 3])


def test_candidates_missing_at_some_depths():
    """-inf log-probs (fewer candidates than k): never nodes; a tree may end smaller than
    its budget, the rest of its rows padding."""
    rng = np.random.default_rng(2)
    lp, ids = random_drafts(rng, 4, 5, 4, holes=True)
    lp[0, 0, :] = -np.inf  # no candidate at all at depth 1: the root alone
    check(lp, ids, 24, 4, [3, 3, 3, 3])


def test_topk_beyond_the_candidates_a_depth_has():
    """k = 4 over drafts of 2 columns (a vocabulary smaller than topk): the 2 there are,
    never the next depth's entries."""
    rng = np.random.default_rng(4)
    lp, ids = random_drafts(rng, 3, 4, 2)
    check(lp, ids, 6, 4, [1, 2, 3])


def test_budget_zero_is_the_root_alone():
    rng = np.random.default_rng(3)
    lp, ids = random_drafts(rng, 2, 4, 2)
    check(lp, ids, 0, 2, [10, 20])


def test_size_bound():
    assert size_bound(16, 8, 1) == 8 and size_bound(16, 8, 4) == 16
    assert size_bound(100, 3, 2) == 2 + 4 + 8 and size_bound(0, 8, 4) == 0


# -- the engine with its DFlash trees built by the kernel ---------------------------------


def device_engine(model, draft, slots=8, max_context=256):
    from ddserve.engine.dflash import DFlashDrafter
    from ddserve.engine.static_engine import StaticEngine

    return StaticEngine(
        model,
        DFlashDrafter(draft, model),
        6,
        (),
        slots=slots,
        max_context=max_context,
        graphs=CUDA,
        device_tree=True,
    )


@pytest.fixture(scope="module")
def tiny():
    from ddserve.engine.weights import random_llama, tiny_config

    model = random_llama(tiny_config(vocab_size=512), seed=3)
    return model.to(DEV)


@pytest.fixture
def oracle_kernel(monkeypatch):
    """Off CUDA the engine's kernel calls go to the oracle (same contract, tested against
    the kernel above; the interpreter takes ~0.4 s a call), except in
    test_engine_with_the_interpreted_kernel; on a GPU the real kernel runs."""
    if not CUDA:
        from ddserve.engine import tree_triton

        monkeypatch.setattr(tree_triton, "build_trees", host_build_trees)


def test_engine_with_the_interpreted_kernel(tiny):
    """The kernel itself inside the engine (interpreted off CUDA): two requests, trees of
    16 nodes, the reference's tokens and accept lengths."""
    from ddserve.config.engine import LiveParams
    from ddserve.engine.sampling import SamplingParams
    from tests.engine.reference import ReferenceDFlash, ReferenceEngine
    from tests.engine.test_batching import PROMPTS, run_lockstep
    from tests.engine.test_lossless import random_dflash

    draft = random_dflash(tiny).to(DEV)
    params = LiveParams(budget=16, topk=4, window=2048)
    ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
    sp = [SamplingParams(max_tokens=n) for n in (6, 4)]
    alone = [ref.generate(p, s, params).output for p, s in zip(PROMPTS, sp, strict=False)]
    assert run_lockstep(device_engine(tiny, draft, slots=2), PROMPTS[:2], sp, params) == alone


def test_engine_decodes_like_the_reference(tiny, oracle_kernel):
    """Greedy, alone and in lockstep with late joiners, trees of several shapes: the tokens and
    accept lengths of the reference engine (host trees, its own verify), tree for tree."""
    from ddserve.config.engine import LiveParams
    from ddserve.engine.sampling import SamplingParams
    from tests.engine.reference import ReferenceDFlash, ReferenceEngine, record_trees
    from tests.engine.test_batching import PROMPTS, run_lockstep
    from tests.engine.test_lossless import random_dflash

    draft = random_dflash(tiny).to(DEV)
    lengths = [30, 12, 25, 40, 5]
    for budget, topk, window in [(16, 4, 4), (8, 1, 2048), (1, 3, 2048)]:
        params = LiveParams(budget=budget, topk=topk, window=window)
        ref = ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ())
        eng = device_engine(tiny, draft)
        want_trees, got_trees = record_trees(ref), record_trees(eng)
        sp = [SamplingParams(max_tokens=n) for n in lengths]
        alone = [ref.generate(p, s, params) for p, s in zip(PROMPTS, sp, strict=True)]
        mine = [eng.generate(p, s, params) for p, s in zip(PROMPTS, sp, strict=True)]
        label = f"budget={budget} topk={topk} window={window}"
        assert got_trees == want_trees, label
        assert [s.output for s in mine] == [s.output for s in alone], label
        assert [s.stats.accept_lengths for s in mine] == [s.stats.accept_lengths for s in alone], (
            label
        )
        together = run_lockstep(eng, PROMPTS, sp, params, join_late={2, 4})
        assert together == [s.output for s in alone], label


def test_engine_sampling_follows_the_target_distribution(oracle_kernel):
    """T=1 through device-built trees: pair frequencies match exact enumeration."""
    from tests.engine.test_batching import check_batched_sampling
    from tests.engine.test_lossless import random_dflash

    check_batched_sampling(
        lambda target, _: device_engine(target.to(DEV), random_dflash(target).to(DEV), 8, 64),
        n=800,
        tv=0.09,
    )


def test_engine_logprobs_bias_and_changing_budgets(tiny, oracle_kernel):
    """Requests with log-probs and a logit_bias share rounds whose budget changes (budget 0
    runs between drafts, as adaptive speculation does): greedy ones equal the reference's
    output, and the log-probs the reference reports."""
    from ddserve.config.engine import LiveParams
    from ddserve.engine.sampling import SamplingParams
    from tests.engine.reference import ReferenceDFlash, ReferenceEngine
    from tests.engine.test_batching import PROMPTS
    from tests.engine.test_lossless import random_dflash

    draft = random_dflash(tiny).to(DEV)
    bias = ((5, -100.0), (300, 1.5))
    sampling = [
        SamplingParams(max_tokens=40, logprobs=2),
        SamplingParams(max_tokens=40, logit_bias=bias),
        SamplingParams(max_tokens=40),
    ]
    schedule = [8, 0, 0, 3, *[0] * 9, 16, 1, 0, 7]
    outs = []
    for e in (
        ReferenceEngine(tiny, ReferenceDFlash(draft, tiny), 6, ()),
        device_engine(tiny, draft),
    ):
        seqs = [e.new_sequence(p, s) for p, s in zip(PROMPTS, sampling, strict=False)]
        for s in seqs:
            e.prefill(s)
        for budget in schedule * 4:
            active = [s for s in seqs if not s.finished]
            if active:
                e.step_batch(active, LiveParams(budget=budget, topk=2))
        outs.append(seqs)
    ref, mine = outs
    assert [s.output for s in mine] == [s.output for s in ref]
    assert [s.stats.accept_lengths for s in mine] == [s.stats.accept_lengths for s in ref]
    assert mine[0].logprobs.chosen == pytest.approx(ref[0].logprobs.chosen, abs=1e-4)
    assert mine[0].logprobs.top_ids == ref[0].logprobs.top_ids
