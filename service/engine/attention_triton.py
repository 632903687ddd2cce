"""The triton backend of ddserve.engine.attention (imported only where triton is): the kernel,
its split-merge kernel, and the torch op `ddserve::tree_attention` around them.

Grid: (B x kv heads, query blocks, key splits). A program holds BLOCK_M folded query rows
(row m = token m // G, head kvh*G + m % G) of one request and one kv head, and runs the online
softmax over its share of that request's visible keys [lo, past + new_hi) in BLOCK_N steps, committed keys first
(no mask to load), then the new ones:
    committed keys j < past         visible (j >= lo)
    new keys j = past + u, u < W     visible by mode: TREE tree[b, t, u]; CAUSAL u <= t; FULL
With one split it writes the output; with several it writes (m, l, acc) partials that
`_merge` combines (a program per folded row, every split loaded at once). The number of
splits depends only on the grid's other dimensions (shapes), never on lengths, so a CUDA
graph of one shape replays for every context. MODE is
ddserve.engine.attention's TREE 0 / CAUSAL 1 / FULL 2 (this module does not import it: that
module imports this one where triton is); 3 = committed keys only (internal).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ddserve.engine.triton_hopper import (
    bulk_aligned,
    launch_kwargs,
    launch_next,
    prefetch_l2,
    wait_prev,
)

NEG = tl.constexpr(-1.0e30)  # a finite -inf: an empty split or row stays NaN-free


@triton.jit
def _attn(
    Q, K, V, Rows, Past, Tree, Window, Out, Mp, Lp, Ap,
    sq_n, sq_h, sk_s, sk_h, sk_l, so_n, so_h,
    W, G, KVH, SPLITS, MPAD, LEN, sm_scale,
    HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    # PDL (ddserve.engine.triton_hopper): before the wait only what was made before the
    # forward's first layer (Rows, Past, Window) and the committed keys (no layer writes
    # them) are read; q and this forward's keys come from the kernels just before
    launch_next(PDL)
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // KVH
    kh = pid_bh % KVH
    slot = tl.load(Rows + b)
    past = tl.load(Past + b)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_idx < G * W
    t = m_idx // G
    head = kh * G + m_idx % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HD
    # the keys any row of this block may see: [lo, hi)
    if MODE == 1:  # CAUSAL: up to the block's last token
        t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, W - 1)
        hi = past + t_last + 1
    else:
        hi = past + W
    hi = tl.minimum(hi, LEN)  # a prompt chunk's padding may run past the slot: never read it
    lo = past * 0
    if HAS_WINDOW:
        lo = tl.maximum(past - tl.load(Window + b), 0)
    per = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + pid_s * per
    s_hi = tl.minimum(s_lo + per, hi)
    base = slot * sk_s + kh * sk_h
    mid = tl.maximum(s_lo, tl.minimum(s_hi, past))
    if PREFETCH > 0:  # the split's committed keys and values (rows of HD) into L2: the first
        n_pf = tl.minimum(mid - s_lo, PREFETCH)  # PREFETCH of them
        if n_pf > 0:
            nbytes = (n_pf * HD * K.dtype.element_ty.primitive_bitwidth // 8).to(tl.int32)
            prefetch_l2(K + base + s_lo * sk_l, nbytes)
            prefetch_l2(V + base + s_lo * sk_l, nbytes)
    wait_prev(PDL)
    q = tl.load(
        Q + (b * W + t)[:, None] * sq_n + head[:, None] * sq_h + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # committed keys first: every row sees them all (no mask but the range), then the new ones
    # under the mode's mask; the committed loop, most of a long context, loads no mask
    for start in range(s_lo, mid, BLOCK_N):
        m_i, l_i, acc = _keys(
            q, K + base, V + base, Tree, start, mid, past, b, t, m_ok, d, d_ok, sk_l, W, m_i,
            l_i, acc, sm_scale, BLOCK_N, 3, IEEE,
        )  # fmt: skip
    for start in range(mid, s_hi, BLOCK_N):
        m_i, l_i, acc = _keys(
            q, K + base, V + base, Tree, start, s_hi, past, b, t, m_ok, d, d_ok, sk_l, W, m_i,
            l_i, acc, sm_scale, BLOCK_N, MODE, IEEE,
        )  # fmt: skip
    if SPLIT:
        at = (pid_bh * SPLITS + pid_s) * MPAD + m_idx
        tl.store(Mp + at, m_i)
        tl.store(Lp + at, l_i)
        tl.store(Ap + at[:, None] * BLOCK_D + d[None, :], acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (b * W + t)[:, None] * so_n + head[:, None] * so_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _keys(
    q, Kb, Vb, Tree, start, end, past, b, t, m_ok, d, d_ok, sk_l, W, m_i, l_i, acc, sm_scale,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N step of the online softmax over keys [start, end). MODE 3: committed keys
    only (visible to every row)."""
    j = start + tl.arange(0, BLOCK_N)
    j_ok = j < end
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(Kb + j[:, None] * sk_l + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * sm_scale
    u = j - past  # index among the new entries (< 0: committed)
    if MODE == 0:  # TREE
        in_new = (u >= 0) & (u < W)
        seen = tl.load(
            Tree + (b * W + t)[:, None] * W + u[None, :],
            mask=m_ok[:, None] & in_new[None, :] & j_ok[None, :],
            other=0,
        )
        vis = (u[None, :] < 0) | (seen != 0)
    elif MODE == 1:  # CAUSAL
        vis = u[None, :] <= t[:, None]
    elif MODE == 2:  # FULL
        vis = u[None, :] < W
    else:  # committed
        vis = u[None, :] < 0
    vis = vis & j_ok[None, :] & m_ok[:, None]
    s = tl.where(vis, s, NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    p = tl.where(vis, p, 0.0)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(Vb + j[:, None] * sk_l + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _merge(
    Mp, Lp, Ap, Out, so_n, so_h, W, G, KVH, SPLITS, MPAD,
    HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One folded query row of one kv head: every split's (m, l, acc) loaded at once (no loop
    over the splits: a loop of dependent loads made this kernel ~12 us a layer at 32 splits
    with the decode's 3 programs, more than the split attention itself, on the H200)."""
    launch_next(PDL)
    wait_prev(PDL)
    pid_bh = tl.program_id(0)
    m_idx = tl.program_id(1)
    b = pid_bh // KVH
    kh = pid_bh % KVH
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    at = (pid_bh * SPLITS + s) * MPAD + m_idx
    ms = tl.load(Mp + at, mask=s_ok, other=NEG)
    f = tl.exp(ms - tl.max(ms, 0))  # an empty split (m = NEG, l = 0) weighs nothing
    l_all = tl.sum(tl.load(Lp + at, mask=s_ok, other=0.0) * f, 0)
    acc = tl.load(Ap + at[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * f[:, None], 0) / tl.where(l_all > 0, l_all, 1.0)
    t = m_idx // G
    head = kh * G + m_idx % G
    tl.store(Out + (b * W + t) * so_n + head * so_h + d, out.to(Out.dtype.element_ty), mask=d < HD)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (132 on an H200); 1 off CUDA (the interpreter runs programs
    one by one, so splitting the keys only costs time there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# wide prompt chunks (causal, at least WIDE tokens): larger query blocks, narrower key steps,
# 8 warps, 3 stages. On the H200 (bench.prefill_attention, results/long-context-h200/run4) a
# 2,048-token chunk after 2,048 / 5,120 committed keys took 0.127 / 0.202 ms a layer against
# 0.170 / 0.318 with the decode-shaped launch, 1,024 from the start 0.090 against 0.119 (2,048
# from the start 0.080 against 0.075); the decode-shaped launch was 26 of a 7,200-token
# prefill's 35 ms
WIDE = 1024
WIDE_TUNE = {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}

# keys (and their values) a program prefetches into L2 before its wait (launch's `prefetch`):
# all of a short context's, and only a bounded start of each split of a long one, so that a
# wide batch's prefetches do not evict one another from the H200's 60 MB of L2
PREFETCH_KEYS = 512


def tuning(mode: int, w: int) -> dict:
    """The launch parameters of a forward's shape (empty: the decode-shaped defaults)."""
    return dict(WIDE_TUNE) if mode == 1 and w >= WIDE else {}


# Tree forwards (verify, decode) and the drafter's blocks (FULL) of at most this many folded
# query rows (G x W) take 16-row query blocks; in short contexts (<= 512 keys) they split their
# keys (at least 64 a split) up to about WIDE_TREE_FILL programs per multiprocessor when they
# have more than 16 folded rows (fewer: as decode always did, up to 4 per multiprocessor where
# its blocks fit on the GPU); in long ones as every forward does. Until 2026-12-06 only forwards
# of at most 16 folded rows did either (the others: one program per kv head and query block of
# up to 64 rows over all keys), so a verify of 1 x 16 tree rows (48 folded) ran 3 programs: 13.7
# us a layer at 256 keys on the H100, 5.9 now; 16 x 16 rows 15.4 -> 11.2; at 2,048 keys 15.4 ->
# 9.2 and 48.0 -> 29.3; the drafter's block of 8 / 16 rows at 256 keys 9.0 / 9.5 -> 5.0 / 4.1 in
# the grid's best (16-row blocks, 8 splits: the rule's) (bench.verify_attention, bench/NOTES.md
# "Twenty-third session"). Benchmarks set both (bench.tuned)
SPLIT_TREE_MAX_ROWS = 96
WIDE_TREE_FILL = 0.55


def split_plan(
    b: int, w: int, g: int, kvh: int, mode: int, ctx: int, sms: int, tune: dict | None = None
) -> tuple[int, int]:
    """(query rows a program takes, key splits) of a forward of b requests x w rows, g query heads
    per kv head, context class ctx, on sms multiprocessors. Depends only on shapes, never on
    lengths, so a CUDA graph of one shape replays for every context. Long classes split into at
    least 256 keys a split, up to 4 programs per multiprocessor; short ones only tree and
    drafter-block forwards (see SPLIT_TREE_MAX_ROWS); never more than 32 splits. On the H200 at
    256 keys (one attention per layer in a chain, the merge included): 1 row 8.3 -> 4.8 us a
    layer with 4 splits, 32 rows (B=32) 12.8 -> 8.6 ("Eleventh session"); on the H100 (above):
    at 1 x 16 tree rows 2-8 splits within 4% of one another, 4 x 16 best at 2, 8 x 16 and wider
    unsplit."""
    tune = tune or {}
    rows_g = g * w
    tree = mode in (0, 2) and rows_g <= SPLIT_TREE_MAX_ROWS  # TREE or FULL (not prompts)
    block_m = tune.get("block_m") or (16 if tree or rows_g <= 16 else (32 if rows_g <= 32 else 64))
    programs = b * kvh * triton.cdiv(rows_g, block_m)
    fill = tune.get("fill", 4) * sms
    if ctx > 512:
        room = ctx // 256
    elif tree and rows_g > 16:
        room = max(1, ctx // 64)
        fill = tune.get("fill", WIDE_TREE_FILL) * sms
    elif tree and programs <= sms:
        room = max(1, ctx // 64)
    else:
        room = 1
    return block_m, max(1, min(room, 32, int(fill // programs)))


def launch(
    q, kc, vc, rows, past, tree, window, w: int, mode: int, ctx: int = 0, splits=None,
    pdl: bool = False, prefetch: bool = False, **tune
):  # fmt: skip
    """q [B*W, nh, hd] -> out [B*W, nh, hd]. See the module docstring. `ctx`: no row has more
    keys (0: the pool's length). `pdl`: launched as a link of ddserve.engine.layer_triton's
    programmatic-dependent-launch chain (Hopper; rows, past and window must have been made
    before the forward's first layer). `prefetch`: each program's first PREFETCH_KEYS
    committed keys and values into L2 first (Hopper). `tune` (benchmarks): block_m, block_n,
    num_warps, num_stages, fill (programs per multiprocessor to aim at)."""
    tune = {**tuning(mode, w), **tune}
    n, nh, hd = q.shape
    kvh = kc.shape[1]
    g, b = nh // kvh, n // w
    rows_g = g * w
    block_n = tune.get("block_n", 64)
    block_d = triton.next_power_of_2(hd)
    sms = multiprocessors(q.device)
    block_m, auto_splits = split_plan(b, w, g, kvh, mode, ctx or kc.shape[2], sms, tune)
    mblocks = triton.cdiv(rows_g, block_m)
    splits = splits or auto_splits
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.stride(2) != 1:
        q = q.contiguous()
    assert kc.stride() == vc.stride() and kc.stride(3) == 1, "K and V pools share one layout"
    ieee = q.dtype == torch.float32
    tree_t = tree if tree is not None else past  # unused unless MODE == TREE
    win = window if window is not None else past
    mpad = mblocks * block_m
    pdl_launch = launch_kwargs(pdl)
    # prefetched key ranges: contiguous rows (the pools share one layout) starting aligned
    prefetch = prefetch and kc.stride(2) == hd and all(bulk_aligned(t, (0, 1, 2)) for t in (kc, vc))
    if splits > 1:
        mp = torch.empty(b * kvh * splits * mpad, device=q.device, dtype=torch.float32)
        lp = torch.empty_like(mp)
        ap = torch.empty(b * kvh * splits * mpad * block_d, device=q.device, dtype=torch.float32)
    else:
        mp = lp = ap = out
    _attn[(b * kvh, mblocks, splits)](
        q, kc, vc, rows, past, tree_t, win, out, mp, lp, ap,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        out.stride(0), out.stride(1),
        w, g, kvh, splits, mpad, kc.shape[2], 1.0 / math.sqrt(hd),
        HD=hd, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        MODE=mode, HAS_WINDOW=window is not None, SPLIT=splits > 1, IEEE=ieee, PDL=pdl,
        PREFETCH=PREFETCH_KEYS if prefetch else 0,
        **{k: tune[k] for k in ("num_warps", "num_stages") if k in tune}, **pdl_launch,
    )  # fmt: skip
    if splits > 1:
        _merge[(b * kvh, rows_g)](
            mp, lp, ap, out, out.stride(0), out.stride(1), w, g, kvh, splits, mpad,
            HD=hd, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), PDL=pdl, **pdl_launch,
        )  # fmt: skip
    return out


@torch.library.custom_op("ddserve::tree_attention", mutates_args=())
def tree_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    rows: torch.Tensor,
    past: torch.Tensor,
    tree: torch.Tensor | None,
    window: torch.Tensor | None,
    w: int,
    mode: int,
    ctx: int,
) -> torch.Tensor:
    return launch(q, kc, vc, rows, past, tree, window, w, mode, ctx)


@tree_attention.register_fake
def _(q, kc, vc, rows, past, tree, window, w, mode, ctx):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
