"""The best-first tree build of ddserve.engine.tree on the GPU: one triton program per
request turns its drafter's top-k per depth into the verify's inputs, with no host round trip
(imported only where triton is; the static engine uses it for the DFlash drafter on CUDA).

The heap of `build_tree_top`, as a frontier of fixed slots in push order: slot 0 is the first
candidate (depth 1, rank 0); step t pops the best live slot (the first one among equal
weights: the heap's tie order, since slots are numbered in push order) as node t + 1, then
pushes its next sibling into slot 2t + 1 and its first child into slot 2t + 2 (either only
when it exists and its log-prob is finite, as the host skips -inf). Weights are float64 and
add up in the host's order (parent's weight + the candidate's log-prob), so the two builds
agree node for node. A node's attention row is its parent's row plus itself (parents are
built first; a barrier ends every step, so the parent's row is in memory). (A version that
held the top-k table in registers, with no memory access or barrier per step, and made the
mask after the steps, each row climbing to the root, measured 1.5-2.7x slower on the H100:
15.5 against 10.6 us for one b15/k4 tree, 205 against 75 for b63/k8; bench/NOTES.md,
twenty-sixth session. Its code is in commit 2f1cf29.)

Outputs per request b, node i < W (W = a power of two >= the tree's largest size): token,
RoPE position (committed length + depth), parent (-1 the root, -2 a padding row), path
log-weight, and the [W, W] ancestor mask (int, nonzero = visible; padding rows see only
themselves): the verify's token, position and tree inputs, and what the host needs after the
verify (parents, weights) to walk the accepted path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddserve.engine.tree import size_bound


@triton.jit
def _flag(c):
    """A scalar condition as one that combines with vectors (triton's interpreter cannot `&`
    a vector with a scalar that came from a float comparison)."""
    return tl.where(c, 1, 0) != 0


@triton.jit
def _build(
    LP, IDS, ROOT, LENS, TOK, POS, PAR, LOGW, MASK,
    s_b, s_d, depth_limit, k, budget,
    W: tl.constexpr, F: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    base = tl.load(LENS + b)
    n = tl.arange(0, W)
    f = tl.arange(0, F)
    neg_inf = float("-inf")
    lp_b = LP + b * s_b
    ids_b = IDS + b * s_b
    # every row sees itself; a node's row gains its ancestors when it is made
    for i in range(0, W):
        tl.store(MASK + (b * W + i) * W + n, (n == i).to(tl.int64))
    tok = tl.where(n == 0, tl.load(ROOT + b), 0).to(tl.int64)
    par = tl.where(n == 0, -1, -2).to(tl.int64)
    dep = tl.zeros([W], dtype=tl.int64)
    logw = tl.zeros([W], dtype=tl.float64)
    # the frontier: candidate slots in push order (slot 0 = depth 1, rank 0 under the root)
    lp0 = tl.load(lp_b)
    c_alive = (f == 0) & _flag(lp0 > neg_inf)
    c_logw = tl.where(f == 0, 0.0 + lp0, neg_inf).to(tl.float64)
    c_dep = tl.where(f == 0, 1, 0).to(tl.int64)
    c_rank = tl.zeros([F], dtype=tl.int64)
    c_par = tl.zeros([F], dtype=tl.int64)
    tl.debug_barrier()
    for t in range(0, budget):
        best = tl.argmax(tl.where(c_alive, c_logw, neg_inf), 0)
        sel = f == best
        ok = _flag(tl.sum((sel & c_alive).to(tl.int32), 0) > 0)  # a live candidate was popped
        d = tl.sum(tl.where(sel, c_dep, 0), 0)
        r = tl.sum(tl.where(sel, c_rank, 0), 0)
        p = tl.sum(tl.where(sel, c_par, 0), 0)
        w = tl.sum(tl.where(sel, c_logw, 0.0), 0)
        node = t + 1
        at = (d - 1) * s_d + r
        token = tl.load(ids_b + at, mask=ok, other=0)
        mine = (n == node) & ok
        tok = tl.where(mine, token, tok)
        par = tl.where(mine, p, par)
        dep = tl.where(mine, d, dep)
        logw = tl.where(mine, w, logw)
        row = tl.load(MASK + (b * W + p) * W + n, mask=(n >= 0) & ok, other=0)
        tl.store(MASK + (b * W + node) * W + n, row | (n == node).to(tl.int64), mask=ok)
        c_alive = c_alive & ~sel
        # its next sibling (same parent, rank + 1) and its first child (depth + 1, rank 0)
        sib_ok = _flag(ok & (r + 1 < k))
        sib_lp = tl.load(lp_b + at + 1, mask=sib_ok, other=neg_inf)
        parent_w = tl.sum(tl.where(n == p, logw, 0.0), 0)
        sib_ok = _flag(sib_ok & (sib_lp > neg_inf))  # NaN fails too
        s = f == 2 * t + 1
        c_alive = c_alive | (s & sib_ok)
        c_logw = tl.where(s, parent_w + sib_lp, c_logw)
        c_dep = tl.where(s, d, c_dep)
        c_rank = tl.where(s, r + 1, c_rank)
        c_par = tl.where(s, p, c_par)
        kid_ok = _flag(ok & (d < depth_limit))
        kid_lp = tl.load(lp_b + d * s_d, mask=kid_ok, other=neg_inf)
        kid_ok = _flag(kid_ok & (kid_lp > neg_inf))
        c = f == 2 * t + 2
        c_alive = c_alive | (c & kid_ok)
        c_logw = tl.where(c, w + kid_lp, c_logw)
        c_dep = tl.where(c, d + 1, c_dep)
        c_rank = tl.where(c, 0, c_rank)
        c_par = tl.where(c, node, c_par)
        tl.debug_barrier()
    out = b * W + n
    tl.store(TOK + out, tok)
    tl.store(POS + out, base + dep)
    tl.store(PAR + out, par)
    tl.store(LOGW + out, logw)


def build_trees(
    top_lp: torch.Tensor,
    top_ids: torch.Tensor,
    root: torch.Tensor,
    lens: torch.Tensor,
    budget: int,
    k: int,
    width: int,
):
    """top_lp [B, D, K'] float64 (each depth's log-probs, descending), top_ids [B, D, K'] int64,
    root [B] and lens [B] int64 -> (tokens, positions, parents [B, W] int64, weights [B, W]
    float64, mask [B, W, W] int64): trees of at most `budget` nodes over the first `k`
    candidates of every depth. W = `width` (>= the largest tree + 1, a power of two)."""
    b, depth, columns = top_lp.shape
    k = min(k, columns)  # fewer candidates than asked (a small vocabulary): only those
    dev = top_lp.device
    if top_lp.stride(2) != 1 or top_ids.stride() != top_lp.stride():
        top_lp, top_ids = top_lp.contiguous(), top_ids.contiguous()
    tok = torch.empty(b, width, dtype=torch.int64, device=dev)
    pos, par = torch.empty_like(tok), torch.empty_like(tok)
    logw = torch.empty(b, width, dtype=torch.float64, device=dev)
    mask = torch.empty(b, width, width, dtype=torch.int64, device=dev)
    steps = size_bound(budget, depth, k)  # no more nodes exist: no empty steps past them
    frontier = triton.next_power_of_2(2 * steps + 1)
    _build[(b,)](
        top_lp, top_ids, root, lens, tok, pos, par, logw, mask,
        top_lp.stride(0), top_lp.stride(1), depth, k, steps,
        W=width, F=frontier,
    )  # fmt: skip
    return tok, pos, par, logw, mask
