"""The triton attention kernel (ddserve.engine.attention_triton) equals the sdpa reference: every
mask mode (tree, causal prefill, the drafter's full block with its window), key splits, GQA;
and a static engine on it decodes token for token like one on the reference.

Without a GPU the kernel runs in triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU),
which is how CI tests it; on a GPU the same tests run the compiled kernel, in fp32 and bf16."""

import functools
import os

import pytest
import torch

from tests.engine.triton_interpreter import (
    CUDA,
    DEV,
    DTYPES,
    interpreted,
    interpreter,  # noqa: F401  (autouse fixture)
)

with interpreted():
    from ddserve.config.engine import LiveParams
    from ddserve.engine import attention as A
    from ddserve.engine import attention_triton as T
    from ddserve.engine.attention_triton import launch

from ddserve.engine.dflash import DFlashDrafter  # noqa: E402
from ddserve.engine.drafters import NoDrafter  # noqa: E402
from ddserve.engine.static_engine import StaticEngine  # noqa: E402
from ddserve.engine.weights import random_llama, tiny_config  # noqa: E402
from tests.engine.reference import decode_with_late_joiner, record_trees  # noqa: E402
from tests.engine.test_batching import PROMPTS  # noqa: E402
from tests.engine.test_lossless import random_dflash  # noqa: E402


def case(b, w, mode, *, slots=6, kvh=3, g=3, hd=64, length=300, window=False, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEV, dtype)

    kc, vc = randn(slots, kvh, length, hd), randn(slots, kvh, length, hd)
    q = randn(b * w, kvh * g, hd)
    rows = torch.randperm(slots, generator=gen)[:b].to(DEV)
    past = torch.randint(0, length - w - 1, (b,), generator=gen)
    past[0] = 0  # a row with no committed keys
    tree = ((torch.rand(b, w, w, generator=gen) < 0.4) | torch.eye(w, dtype=torch.bool)).tril()
    win = torch.randint(1, 40, (b,), generator=gen).to(DEV) if window else None
    return q, kc, vc, rows, past.to(DEV), tree.long().to(DEV), win


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "mode,b,w,splits,window",
    [
        (A.TREE, 3, 1, 1, False),  # AR decode
        (A.TREE, 2, 8, 3, False),  # a tree, keys split three ways
        (A.TREE, 2, 20, None, False),  # the shape's own split count
        (A.CAUSAL, 2, 40, 1, False),  # prompt chunks, several query blocks
        (A.CAUSAL, 1, 16, 2, False),
        (A.FULL, 3, 5, 1, True),  # the drafter's block with its window
        (A.FULL, 2, 9, 2, True),
    ],
)
def test_kernel_equals_reference(mode, b, w, splits, window, dtype):
    q, kc, vc, rows, past, tree, win = case(b, w, mode, window=window, dtype=dtype, seed=b * w)
    g = q.shape[1] // kc.shape[1]
    ref_plan = A.plan("sdpa", past, mode, tree, w, kc.shape[2], g, dtype, win)
    ref = A.attend(q, kc, vc, rows, b, w, ref_plan, False).float()
    out = launch(q, kc, vc, rows, past, tree if mode == A.TREE else None, win, w, mode, 0, splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.reshape(b * w, -1).float() - ref).abs().max().item() < tol
    if mode == A.TREE:  # through the torch op, as the engine calls it
        attn = A.Attn("triton", ctx=kc.shape[2], past=past, tree=tree)
        op = A.attend(q, kc, vc, rows, b, w, attn, True)
        assert (op.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize(
    "w,sms,split",
    [(2, 1, True), (8, 8, True), (8, 1, False)],
    ids=["decode", "tree", "tree-filling-the-gpu"],
)
def test_short_context_splits_trees_on_an_idle_gpu(w, sms, split, monkeypatch):
    """In the short class (<= 512 keys) a tree forward takes 16-row query blocks (W=8: 24
    folded rows, two blocks) and splits its keys (>= 64 a split: the merge kernel runs) while
    its programs leave the multiprocessors idle; on a GPU its blocks fill, it keeps one
    kernel; all equal the reference. (Off CUDA the GPU is one multiprocessor unless patched.)"""
    dtype = DTYPES[-1]
    q, kc, vc, rows, past, tree, _ = case(1, w, A.TREE, kvh=1, length=320, dtype=dtype, seed=w)
    merges, attns = [], []

    class Counting:
        def __init__(self, kernel, seen):
            self.kernel, self.seen = kernel, seen

        def __getitem__(self, grid):
            self.seen.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(T, "_merge", Counting(T._merge, merges))
    monkeypatch.setattr(T, "_attn", Counting(T._attn, attns))
    monkeypatch.setattr(T, "multiprocessors", lambda device: sms)
    ref_plan = A.plan("sdpa", past, A.TREE, tree, w, kc.shape[2], 3, dtype)
    ref = A.attend(q, kc, vc, rows, 1, w, ref_plan, False).float()
    out = launch(q, kc, vc, rows, past, tree, None, w, A.TREE, 320)
    assert bool(merges) == split
    ((_, mblocks, splits),) = attns
    assert (splits > 1) == split
    assert mblocks == -(-3 * w // 16)  # 16-row query blocks
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.reshape(w, -1).float() - ref).abs().max().item() < tol


def test_split_plan_by_shape():
    """The key-split rule on an H100/H200's 132 multiprocessors, SmolLM2's heads (3 query heads
    per kv head, 3 kv heads): (query rows a program, key splits)."""
    plan = functools.partial(T.split_plan, g=3, kvh=3, sms=132)
    tree, short, long = A.TREE, 512, 8192
    assert plan(1, 1, mode=tree, ctx=short) == (16, 8)  # AR decode: 3 programs, split
    assert plan(16, 1, mode=tree, ctx=short) == (16, 8)  # decode: up to 4 programs an SM
    assert plan(64, 1, mode=tree, ctx=short) == (16, 1)  # decode whose blocks fill the GPU
    assert plan(1, 16, mode=tree, ctx=short) == (16, 8)  # a verify of 16 tree rows: 9 blocks
    assert plan(1, 32, mode=tree, ctx=short) == (16, 4)  # 96 folded rows: 18 blocks
    assert plan(4, 16, mode=tree, ctx=short) == (16, 2)  # 36 blocks: ~0.55 programs an SM
    assert plan(16, 16, mode=tree, ctx=short) == (16, 1)  # 144 blocks of 16 rows, unsplit
    assert plan(1, 64, mode=tree, ctx=short) == (64, 1)  # past SPLIT_TREE_MAX_ROWS
    assert plan(1, 16, mode=A.CAUSAL, ctx=short) == (64, 1)  # a prompt chunk, short context
    assert plan(1, 8, mode=A.FULL, ctx=short) == (16, 8)  # the drafter's block: as a tree
    assert plan(1, 16, mode=tree, ctx=long) == (16, 32)  # long: 256 keys a split or more
    assert plan(16, 16, mode=tree, ctx=long) == (16, 3)  # at most 4 programs an SM
    assert plan(1, 64, mode=tree, ctx=long) == (64, 32)
    assert plan(1, 16, mode=tree, ctx=short, tune={"block_m": 32}) == (32, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wide_chunk_launch_equals_reference(dtype):
    """Wide prompt chunks launch with their own blocks (128 query rows, 32-key steps, 8 warps,
    3 stages: measured faster on the H200); that launch equals the reference on a small
    causal case (several query and key blocks, rows with and without committed keys), and
    only causal chunks of at least WIDE tokens get it."""
    b, w = 2, 72
    q, kc, vc, rows, past, _, _ = case(b, w, A.CAUSAL, dtype=dtype, seed=21)
    g = q.shape[1] // kc.shape[1]
    ref_plan = A.plan("sdpa", past, A.CAUSAL, None, w, kc.shape[2], g, dtype)
    ref = A.attend(q, kc, vc, rows, b, w, ref_plan, False).float()
    for splits in (1, 2):
        out = launch(q, kc, vc, rows, past, None, None, w, A.CAUSAL, 0, splits, **T.WIDE_TUNE)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.reshape(b * w, -1).float() - ref).abs().max().item() < tol
    assert T.tuning(A.CAUSAL, T.WIDE) == T.WIDE_TUNE
    assert T.tuning(A.CAUSAL, T.WIDE - 1) == T.tuning(A.TREE, 4096) == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_prefill_equals_reference(dtype):
    """A prompt chunk outside a graph (`plan_ragged`: host lengths, torch's fused kernels):
    rows with and without committed keys, and a row so near the pool's end that its padding
    has no keys, equal the padded-range reference on every row that has keys (the padding rows
    of the last are zero: never read)."""
    b, w, length = 3, 24, 300
    q, kc, vc, rows, past, _, _ = case(b, w, A.CAUSAL, length=length, dtype=dtype, seed=11)
    past[2] = length - 10  # 10 of its 24 rows have keys
    g = q.shape[1] // kc.shape[1]
    ref_plan = A.plan("sdpa", past, A.CAUSAL, None, w, length, g, dtype)
    ref = A.attend(q, kc, vc, rows, b, w, ref_plan, False).float().view(b, w, -1)
    ragged = A.plan_ragged(past.cpu(), rows.cpu())
    out = A.attend(q, kc, vc, rows, b, w, ragged, False).float().view(b, w, -1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out[:2] - ref[:2]).abs().max().item() < tol
    assert (out[2, :10] - ref[2, :10]).abs().max().item() < tol
    assert out[2, 10:].abs().max().item() == 0


@pytest.mark.parametrize("drafter", ["none", "dflash"])
def test_engine_on_the_kernel_decodes_like_the_reference(drafter):
    """Static engines on triton and on sdpa, same model (fp32): the same greedy tokens and
    accept lengths, prompts of 1-40 tokens prefilled (causal) then decoded in one batch, the
    DFlash drafter's windowed block included."""
    model = random_llama(tiny_config(vocab_size=512), seed=3).to(DEV)
    params = LiveParams(budget=6, topk=2, window=8)
    draft = random_dflash(model) if drafter == "dflash" else None
    outs = {}
    for backend in ("sdpa", "triton"):
        d = DFlashDrafter(draft, model) if draft is not None else NoDrafter()
        eng = StaticEngine(
            model, d, 4, (), slots=4, max_context=128, graphs=CUDA, attention=backend
        )
        assert eng.attention == backend
        # every tree verified (the drafter's attention decides it), host- or GPU-built
        drafts = record_trees(eng) if eng.sdraft is not None else []
        # the drafts too (accept lengths), not only the (lossless) output
        outs[backend] = decode_with_late_joiner(eng, PROMPTS[:4], params, 12)
        outs[backend + "-drafts"] = drafts
        if backend == "triton":  # context classes start at 512 (they only bound key splits)
            assert eng.target.ctx_bucket(5) == eng.target.ctx_bucket(500) == 512
    assert outs["triton"] == outs["sdpa"]
    mine, ref = outs["triton-drafts"], outs["sdpa-drafts"]
    assert len(mine) == len(ref) and bool(ref) == (drafter == "dflash")
    assert mine == ref  # tree for tree (tokens, and path weights within fp32 noise)


def test_backend_choice():
    """auto is triton on CUDA only (never the interpreter); explicit triton off CUDA without
    the interpreter is a config error naming the fix; sdpa is always sdpa."""
    from ddserve.errors import ConfigError

    assert A.backend("sdpa", torch.device(DEV)) == "sdpa"
    assert A.backend("auto", torch.device(DEV)) == ("triton" if CUDA else "sdpa")
    if not CUDA:
        assert A.backend("triton", torch.device("cpu")) == "triton"  # interpreter on
        del os.environ["TRITON_INTERPRET"]
        with pytest.raises(ConfigError, match="attention-backend sdpa"):
            A.backend("triton", torch.device("cpu"))
