"""A decoder layer in four triton kernels plus attention, for forwards of few rows (decode
and verify: B x W <= layer_launch.FUSED_MAX_ROWS). Imported only where triton is.

At a few rows a layer is bound by kernel launches, not bytes: SmolLM2's layer reads 7 MB of
weights (~1.7 us at the H200's bandwidth), while torch.compile's version launches ~13
kernels of 1-10 us (norms, four GEMMs, RoPE, cache writes, layout copies, SiLU x up). Here:

    qkv_rope      h = RMSNorm(x); [q;k;v] = h @ Wqkv^T (+ bias); RoPE on q and k; k and v
                  written into the KV pool at each token's write position; q out
                  (a program per head, or per column block of its two rotary halves:
                  two accumulators)
    attention     ddserve.engine.attention (the triton kernel, or the sdpa reference)
    matmul_add    x + att @ Wo^T                    (the residual in the epilogue)
    gate_up       h = RMSNorm(x); silu(h @ Wg^T) * (h @ Wu^T)
    matmul_add    x + act @ Wd^T

Each program takes BLOCK_M rows and BLOCK_N output columns and loops over the input in
BLOCK_K steps (tl.dot: tensor cores in bf16, IEEE fp32 in fp32); few, wide steps, because
at these sizes a step's cost is its memory latency, not its bytes. RMSNorm is folded in:
the program multiplies x by the norm's weight as it loads it, sums x^2 on the way, and
scales the product by each row's 1/rms after the loop (no pass of its own). Outputs are
rounded to the model's dtype where the reference (ddserve.engine.static.layer_step) rounds
them (after each projection, RoPE's products and sum, SiLU, gate x up, the residual adds);
in fp32 the two agree to accumulation order, in bf16 also the norm rounds at another point.
The reference stays the tests' oracle and the path for wide forwards (prefill chunks).

On Hopper the chain of a step's kernels overlaps (PDL and PREFETCH, ddserve.engine.layer_launch):
each kernel lets the next one launch as it starts; the next one has its weight rows prefetched
into L2, then waits for its predecessor before it touches an activation, the pool or its
outputs. Before that wait only weights and the forward's inputs copied in before it started
(slots, write positions, committed lengths) are read, so the results are those of serial
launches, bit for bit (tests/engine/test_layer_triton.py checks it on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddserve.engine import layer_launch
from ddserve.engine.attention import attend
from ddserve.engine.layer_launch import (
    block_m,
    launch_params,
    pdl_on,
    prefetch_bytes,
    prefetch_on,
    split_k,
)
from ddserve.engine.layer_split import k_range, launch_split, reduce1, reduce2, share_bytes
from ddserve.engine.triton_hopper import (
    launch_kwargs,
    launch_next,
    prefetch_l2,
    wait_prev,
)


@triton.jit
def _x_chunk(X, sx, G, m, m_ok, k, H):
    """Rows m, columns k of X [M, H]: x * g in the model's dtype (the norm's weight; the
    row's 1/rms scales the product after the matmul) and x^2 summed over k (fp32)."""
    x = tl.load(X + m[:, None] * sx + k[None, :], mask=m_ok[:, None] & (k < H)[None, :], other=0.0)
    g = tl.load(G + k, mask=k < H, other=0.0)
    xf = x.to(tl.float32)
    return (xf * g[None, :].to(tl.float32)).to(x.dtype), tl.sum(xf * xf, 1)


@triton.jit
def _rows(Wt, n, n_ok, sw, k, K):
    """Rows n, columns k of Wt [N, K] (zeros outside)."""
    return tl.load(
        Wt + n[:, None] * sw + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0
    )


@triton.jit
def _mac(a, w, IEEE: tl.constexpr, GEMV: tl.constexpr):
    """a [BM, BK] @ w [BN, BK]^T in fp32: tl.dot (tensor cores in bf16, IEEE fp32 in fp32;
    BM, BN >= 16), or, GEMV, products summed on the CUDA cores, for blocks of a few rows and
    columns: narrow column blocks give a 1-row forward many programs where tensor-core tiles
    of 16 columns leave most SMs idle (SmolLM2's qkv: 15 programs on 132 SMs). bf16 products
    are exact in fp32 either way, so the two differ only in summation order."""
    if GEMV:
        return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    if IEEE:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _qkv_rope(
    X, NW, Wqkv, Bias, Cos, Sin, Q, KC, VC, Rows, Wpos, WS, Cnt,
    M, H, W, NH, KVH, eps,
    sx, sw, sc, sq_n, sq_h, sk_s, sk_h, sk_l,
    HD: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GEMV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HD // 2
    BLOCKS: tl.constexpr = HALF // BLOCK_N  # column blocks per rotary half
    pid = tl.program_id(0)  # (head, column block); heads: q 0..NH-1, k NH..NH+KVH-1, v after
    pid_m = tl.program_id(1)
    head = pid // BLOCKS
    j = (pid % BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the first rotary half
    col = head * HD + j  # ... in Wqkv; the second half's are col + HALF
    all_n = j < HALF
    k_lo, k_hi = k_range(H, BLOCK_K, SPLIT)  # the input columns this program walks
    launch_next(PDL)
    if PREFETCH > 0:  # the program's weight rows into L2 while the previous kernel runs
        es: tl.constexpr = Wqkv.dtype.element_ty.primitive_bitwidth // 8
        nbytes = tl.full([BLOCK_N], share_bytes(PREFETCH, k_lo, k_hi, es, SPLIT), tl.int32)
        prefetch_l2(Wqkv + col * sw + k_lo, nbytes)
        prefetch_l2(Wqkv + (col + HALF) * sw + k_lo, nbytes)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    # each row's slot and write position before the wait: the forward's inputs, copied in
    # before it starts. Not RoPE's cos/sin: kernels compute them just before the first
    # layer, and a kernel that does not trigger its dependents early triggers them as its
    # programs exit, before its writes are guaranteed visible: only the wait orders them
    slot = tl.load(Rows + m // W, mask=m_ok, other=0)
    pos = tl.load(Wpos + m, mask=m_ok, other=0)
    wait_prev(PDL)
    lo = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    hi = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        h, sq = _x_chunk(X, sx, NW, m, m_ok, k, H)
        ss += sq
        lo += _mac(h, _rows(Wqkv, col, all_n, sw, k, H), IEEE, GEMV)
        hi += _mac(h, _rows(Wqkv, col + HALF, all_n, sw, k, H), IEEE, GEMV)
    if SPLIT > 1:
        lo, hi, ss, last = reduce2(WS, Cnt, lo, hi, ss, pid_m * tl.num_programs(0) + pid,
                                   SPLIT, BLOCK_M, BLOCK_N)  # fmt: skip
        if last:
            _qkv_out(lo, hi, ss, Bias, Cos, Sin, Q, KC, VC, m, m_ok, slot, pos, head, j, col,
                     H, NH, KVH, eps, sc, sq_n, sq_h, sk_s, sk_h, sk_l, HD, HAS_BIAS)  # fmt: skip
    else:
        _qkv_out(lo, hi, ss, Bias, Cos, Sin, Q, KC, VC, m, m_ok, slot, pos, head, j, col,
                 H, NH, KVH, eps, sc, sq_n, sq_h, sk_s, sk_h, sk_l, HD, HAS_BIAS)  # fmt: skip


@triton.jit
def _qkv_out(
    lo, hi, ss, Bias, Cos, Sin, Q, KC, VC, m, m_ok, slot, pos, head, j, col,
    H, NH, KVH, eps, sc, sq_n, sq_h, sk_s, sk_h, sk_l,
    HD: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """_qkv_rope's epilogue: the norm's scale, the bias, RoPE; q out, k and v into the pool."""
    HALF: tl.constexpr = HD // 2
    rstd = (1.0 / tl.sqrt(ss / H + eps))[:, None]
    lo = lo * rstd
    hi = hi * rstd
    dt = Q.dtype.element_ty
    lo = lo.to(dt)
    hi = hi.to(dt)
    if HAS_BIAS:
        lo = (lo + tl.load(Bias + col)[None, :]).to(dt)
        hi = (hi + tl.load(Bias + col + HALF)[None, :]).to(dt)
    if head < NH + KVH:  # RoPE: [lo, hi] * cos + [-hi, lo] * sin
        cs = Cos + m[:, None] * sc + j[None, :]
        sn = Sin + m[:, None] * sc + j[None, :]
        c_lo = tl.load(cs, mask=m_ok[:, None], other=0.0)
        c_hi = tl.load(cs + HALF, mask=m_ok[:, None], other=0.0)
        s_lo = tl.load(sn, mask=m_ok[:, None], other=0.0)
        s_hi = tl.load(sn + HALF, mask=m_ok[:, None], other=0.0)
        lo, hi = (
            ((lo * c_lo).to(dt) - (hi * s_lo).to(dt)).to(dt),
            ((hi * c_hi).to(dt) + (lo * s_hi).to(dt)).to(dt),
        )
    if head < NH:
        at = Q + m[:, None] * sq_n + head * sq_h + j[None, :]
        tl.store(at, lo, mask=m_ok[:, None])
        tl.store(at + HALF, hi, mask=m_ok[:, None])
    else:  # k or v of kv head `kh`: into the pool at (slot of the row, write position)
        is_k = head < NH + KVH
        kh = tl.where(is_k, head - NH, head - NH - KVH)
        off = slot[:, None] * sk_s + kh * sk_h + pos[:, None] * sk_l + j[None, :]
        if is_k:
            tl.store(KC + off, lo, mask=m_ok[:, None])
            tl.store(KC + off + HALF, hi, mask=m_ok[:, None])
        else:
            tl.store(VC + off, lo, mask=m_ok[:, None])
            tl.store(VC + off + HALF, hi, mask=m_ok[:, None])


@triton.jit
def _gate_up(
    X, NW, Wgu, Out, WS, Cnt, M, H, INTER, eps, sx, sw, so,
    IEEE: tl.constexpr, GEMV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    k_lo, k_hi = k_range(H, BLOCK_K, SPLIT)
    launch_next(PDL)
    if PREFETCH > 0:
        n_in = tl.minimum(n, INTER - 1)  # an edge block's rows past the end: its last row
        es: tl.constexpr = Wgu.dtype.element_ty.primitive_bitwidth // 8
        nbytes = tl.full([BLOCK_N], share_bytes(PREFETCH, k_lo, k_hi, es, SPLIT), tl.int32)
        prefetch_l2(Wgu + n_in * sw + k_lo, nbytes)
        prefetch_l2(Wgu + (n_in + INTER) * sw + k_lo, nbytes)
    wait_prev(PDL)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        h, sq = _x_chunk(X, sx, NW, m, m_ok, k, H)
        ss += sq
        g += _mac(h, _rows(Wgu, n, n_ok, sw, k, H), IEEE, GEMV)
        u += _mac(h, _rows(Wgu, n + INTER, n_ok, sw, k, H), IEEE, GEMV)
    if SPLIT > 1:
        g, u, ss, last = reduce2(WS, Cnt, g, u, ss, pid_m * tl.num_programs(0) + pid_n,
                                 SPLIT, BLOCK_M, BLOCK_N)  # fmt: skip
        if last:
            _gate_up_out(g, u, ss, Out, m, m_ok, n, n_ok, H, eps, so)
    else:
        _gate_up_out(g, u, ss, Out, m, m_ok, n, n_ok, H, eps, so)


@triton.jit
def _gate_up_out(g, u, ss, Out, m, m_ok, n, n_ok, H, eps, so):
    """_gate_up's epilogue: the norm's scale, silu(gate) * up, out."""
    rstd = (1.0 / tl.sqrt(ss / H + eps))[:, None]
    g = g * rstd
    u = u * rstd
    dt = Out.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt) * u.to(dt)  # silu(gate) * up
    tl.store(Out + m[:, None] * so + n[None, :], act, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _matmul_add(
    A, Wt, R, Out, WS, Cnt, M, N, K, sa, sw, sr, so,
    IEEE: tl.constexpr, GEMV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out = R + A @ Wt^T  (A [M, K], Wt [N, K], R/Out [M, N])."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_lo, k_hi = k_range(K, BLOCK_K, SPLIT)
    launch_next(PDL)
    if PREFETCH > 0:
        es: tl.constexpr = Wt.dtype.element_ty.primitive_bitwidth // 8
        nbytes = tl.full([BLOCK_N], share_bytes(PREFETCH, k_lo, k_hi, es, SPLIT), tl.int32)
        prefetch_l2(Wt + tl.minimum(n, N - 1) * sw + k_lo, nbytes)
    wait_prev(PDL)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    ok = m_ok[:, None] & n_ok[None, :]
    r = tl.load(R + m[:, None] * sr + n[None, :], mask=ok, other=0.0)  # flies with the loop's
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc += _mac(_rows(A, m, m_ok, sa, k, K), _rows(Wt, n, n_ok, sw, k, K), IEEE, GEMV)
    dt = Out.dtype.element_ty
    if SPLIT > 1:
        acc, last = reduce1(WS, Cnt, acc, pid_m * tl.num_programs(0) + pid_n, SPLIT,
                            BLOCK_M, BLOCK_N)  # fmt: skip
        if last:
            tl.store(Out + m[:, None] * so + n[None, :], (r + acc.to(dt)).to(dt), mask=ok)
    else:
        tl.store(Out + m[:, None] * so + n[None, :], (r + acc.to(dt)).to(dt), mask=ok)


def _launch(kernel, grid, *args, pdl: bool, **meta) -> None:
    """`kernel[grid](*args, **meta)`, with PDL=pdl (and launched with it)."""
    kernel[grid](*args, PDL=pdl, **meta, **launch_kwargs(pdl))


def qkv_rope(block, x, cos, sin, kc, vc, rows, wpos, ctx: int = 0, batch: int = 1) -> torch.Tensor:
    """q [M, nh, hd] with RoPE; k, v written into the pools kc/vc [S, kvh, L, hd] at
    (rows[m // W], wpos[m]). x [M, H]; cos/sin [M, hd]; rows [B]; wpos [B, W]. `ctx`: the
    forward's context class, `batch` its slots (whether it overlaps: pdl_on)."""
    c = block.cfg
    m, h = x.shape
    nh, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q = torch.empty(m, nh, hd, device=x.device, dtype=x.dtype)
    bn, bk, warps, stages = launch_params("qkv", m)
    bn = min(bn or hd // 2, hd // 2)
    bm = block_m(m, bn)
    w = block.qkv_weight
    bias = block.qkv_bias
    assert kc.stride() == vc.stride() and kc.stride(3) == 1, "K and V pools share one layout"
    norm = block.input_layernorm
    grid = ((nh + 2 * kvh) * (hd // 2 // bn), triton.cdiv(m, bm))
    pf = prefetch_bytes(w, ctx, batch, m)
    split, ws, cnt, pf = launch_split(split_k("qkv", m), w, h, grid[0] * grid[1], bm, bn, bk, 2, pf)
    _launch(
        _qkv_rope, (*grid, split),
        x, norm.weight, w, bias if bias is not None else w, cos, sin, q, kc, vc, rows, wpos,
        ws, cnt, m, h, wpos.shape[1], nh, kvh, norm.eps,
        x.stride(0), w.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        HD=hd, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, GEMV=bn < 16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=pf, SPLIT=split,
        num_warps=warps, num_stages=stages, pdl=pdl_on(x.device, ctx, batch, m),
    )  # fmt: skip
    return q


def gate_up(block, x, ctx: int = 0, batch: int = 1) -> torch.Tensor:
    """silu(h @ Wg^T) * (h @ Wu^T), h = post-attention RMSNorm(x): [M, I]."""
    m, h = x.shape
    w = block.gate_up_weight
    inter = w.shape[0] // 2
    out = torch.empty(m, inter, device=x.device, dtype=x.dtype)
    bn, bk, warps, stages = launch_params("gate_up", m)
    bm = block_m(m, bn)
    norm = block.post_attention_layernorm
    grid = (triton.cdiv(inter, bn), triton.cdiv(m, bm))
    pf = prefetch_bytes(w, ctx, batch, m)
    split, ws, cnt, pf = launch_split(
        split_k("gate_up", m), w, h, grid[0] * grid[1], bm, bn, bk, 2, pf
    )
    _launch(
        _gate_up, (*grid, split),
        x, norm.weight, w, out, ws, cnt, m, h, inter, norm.eps,
        x.stride(0), w.stride(0), out.stride(0),
        IEEE=x.dtype == torch.float32, GEMV=bn < 16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREFETCH=pf, SPLIT=split, num_warps=warps, num_stages=stages,
        pdl=pdl_on(x.device, ctx, batch, m),
    )  # fmt: skip
    return out


def matmul_add(a, w, r, kernel: str, ctx: int = 0, batch: int = 1) -> torch.Tensor:
    """r + a @ w^T: a [M, K], w [N, K], r [M, N]; `kernel` names its launch parameters."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    bn, bk, warps, stages = launch_params(kernel, m)
    bm = block_m(m, bn)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    pf = prefetch_bytes(w, ctx, batch, m)
    split, ws, cnt, pf = launch_split(
        split_k(kernel, m), w, k, grid[0] * grid[1], bm, bn, bk, 1, pf
    )
    _launch(
        _matmul_add, (*grid, split),
        a, w, r, out, ws, cnt, m, n, k, a.stride(0), w.stride(0), r.stride(0), out.stride(0),
        IEEE=a.dtype == torch.float32, GEMV=bn < 16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREFETCH=pf, SPLIT=split, num_warps=warps, num_stages=stages,
        pdl=pdl_on(a.device, ctx, batch, m),
    )  # fmt: skip
    return out


def _attend(q, kc, vc, rows, b, w, attn, rows_are_slots) -> torch.Tensor:
    """The layer's attention; the triton kernel as a link of the PDL chain, and prefetching
    its committed keys, where those run."""
    m = q.shape[0]
    pdl, prefetch = pdl_on(q.device, attn.ctx, b, m), prefetch_on(q.device, attn.ctx, b, m)
    if attn.backend == "triton" and (pdl or prefetch):
        from ddserve.engine.attention_triton import launch

        out = launch(
            q, kc, vc, rows, attn.past, attn.tree, attn.window, w, attn.mode, attn.ctx,
            pdl=pdl, prefetch=prefetch,
        )  # fmt: skip
        return out.view(q.shape[0], -1)
    return attend(q, kc, vc, rows, b, w, attn, rows_are_slots)


def fused_layer_step(block, x, cos, sin, kc, vc, rows, wpos, attn, rows_are_slots):
    """ddserve.engine.static.layer_step (same arguments, same result up to accumulation
    order) in four triton kernels plus attention."""
    b, w = wpos.shape
    ctx = attn.ctx
    q = qkv_rope(block, x, cos, sin, kc, vc, rows, wpos, ctx, b)
    att = _attend(q, kc, vc, rows, b, w, attn, rows_are_slots)
    x = matmul_add(att, block.o_proj.weight, x, "o", ctx, b)
    return matmul_add(gate_up(block, x, ctx, b), block.down_proj.weight, x, "down", ctx, b)


def fusable(cfg) -> bool:
    """Shapes the kernels take: a head's rotary halves are tl.dot operands (>= 16 wide, a
    power of two)."""
    return cfg.head_dim in (32, 64, 128, 256)


def with_fused_layers(layer_fn):
    """A layer function that runs forwards of at most layer_launch.FUSED_MAX_ROWS rows through
    the fused kernels and wider ones through `layer_fn` (the compiled or eager reference)."""

    def step(block, x, cos, sin, kc, vc, rows, wpos, attn, rows_are_slots):
        if x.shape[0] <= layer_launch.FUSED_MAX_ROWS and fusable(block.cfg):
            return fused_layer_step(block, x, cos, sin, kc, vc, rows, wpos, attn, rows_are_slots)
        return layer_fn(block, x, cos, sin, kc, vc, rows, wpos, attn, rows_are_slots)

    return step
