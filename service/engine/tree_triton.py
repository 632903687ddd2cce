"""The best-first tree build of ddserve.engine.tree on the GPU: one triton program per
request turns its drafter's top-k per depth into the verify's inputs, with no host round trip
(imported only where triton is; the static engine uses it for the DFlash drafter on CUDA).

The heap of `build_tree_top`, as a frontier of fixed slots in push order: slot 0 is the first
candidate (depth 1, rank 0); step t pops the best live slot (the first one among equal
weights: the heap's tie order, since slots are numbered in push order) as node t + 1, then
pushes its next sibling into slot 2t + 1 and its first child into slot 2t + 2 (either only
when it exists and its log-prob is finite, as the host skips -inf). Weights are float64 and
add up in the host's order (parent's weight + the candidate's log-prob), so the two builds
agree node for node. The program first loads its top-k table into registers, so the
steps (one per node, serial) touch no memory; the ancestor mask is made after them, every
row climbing from its node to the root at once (before, each step loaded its table entries
and its parent's mask row from memory and ended on a barrier).

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
def _pick(idx, at, table, fill):
    """table[at] of a vector held in registers (`idx` its indices; `fill` where at is out of
    range): the max over the one matching entry, so no other entry (a NaN) mixes in."""
    return tl.max(tl.where(idx == at, table, fill), 0)


@triton.jit
def _build(
    LP, IDS, ROOT, LENS, TOK, POS, PAR, LOGW, MASK,
    s_b, s_d, depth_limit, k, budget,
    W: tl.constexpr, F: tl.constexpr, T: tl.constexpr, R: tl.constexpr, DMAX: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    base = tl.load(LENS + b)
    n = tl.arange(0, W)
    f = tl.arange(0, F)
    neg_inf = float("-inf")
    # the drafter's top k of every depth, in registers: table entry (d - 1) * s_d + r (the
    # loop below reads them with no memory access, so its steps need no barrier)
    t_at = tl.arange(0, T)
    t_ok = (t_at // s_d < depth_limit) & (t_at % s_d < k)
    t_lp = tl.load(LP + b * s_b + t_at, mask=t_ok, other=neg_inf)
    t_id = tl.load(IDS + b * s_b + t_at, mask=t_ok, other=0)
    tok = tl.where(n == 0, tl.load(ROOT + b), 0).to(tl.int64)
    par = tl.where(n == 0, -1, -2).to(tl.int64)
    dep = tl.zeros([W], dtype=tl.int64)
    logw = tl.zeros([W], dtype=tl.float64)
    # the frontier: candidate slots in push order (slot 0 = depth 1, rank 0 under the root)
    lp0 = _pick(t_at, 0, t_lp, neg_inf)
    c_alive = (f == 0) & _flag(lp0 > neg_inf)
    c_logw = tl.where(f == 0, 0.0 + lp0, neg_inf).to(tl.float64)
    c_dep = tl.where(f == 0, 1, 0).to(tl.int64)
    c_rank = tl.zeros([F], dtype=tl.int64)
    c_par = tl.zeros([F], dtype=tl.int64)
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
        token = tl.where(ok, _pick(t_at, at, t_id, 0), 0)
        mine = (n == node) & ok
        tok = tl.where(mine, token, tok)
        par = tl.where(mine, p, par)
        dep = tl.where(mine, d, dep)
        logw = tl.where(mine, w, logw)
        c_alive = c_alive & ~sel
        # its next sibling (same parent, rank + 1) and its first child (depth + 1, rank 0)
        sib_ok = _flag(ok & (r + 1 < k))
        sib_lp = tl.where(sib_ok, _pick(t_at, at + 1, t_lp, neg_inf), neg_inf)
        parent_w = tl.sum(tl.where(n == p, logw, 0.0), 0)
        sib_ok = _flag(sib_ok & (sib_lp > neg_inf))  # NaN fails too
        s = f == 2 * t + 1
        c_alive = c_alive | (s & sib_ok)
        c_logw = tl.where(s, parent_w + sib_lp, c_logw)
        c_dep = tl.where(s, d, c_dep)
        c_rank = tl.where(s, r + 1, c_rank)
        c_par = tl.where(s, p, c_par)
        kid_ok = _flag(ok & (d < depth_limit))
        kid_lp = tl.where(kid_ok, _pick(t_at, d * s_d, t_lp, neg_inf), neg_inf)
        kid_ok = _flag(kid_ok & (kid_lp > neg_inf))
        c = f == 2 * t + 2
        c_alive = c_alive | (c & kid_ok)
        c_logw = tl.where(c, w + kid_lp, c_logw)
        c_dep = tl.where(c, d + 1, c_dep)
        c_rank = tl.where(c, 0, c_rank)
        c_par = tl.where(c, node, c_par)
    out = b * W + n
    tl.store(TOK + out, tok)
    tl.store(POS + out, base + dep)
    tl.store(PAR + out, par)
    tl.store(LOGW + out, logw)
    # the ancestor mask, R rows at a time: each row climbs from its node to the root (a
    # node's depth is at most DMAX), marking every node it passes; padding rows (parent -2)
    # mark themselves only
    j = tl.arange(0, W)
    for r0 in range(0, W, R):
        i = r0 + tl.arange(0, R)
        seen = j[None, :] == i[:, None]
        cur = i
        for _ in range(0, DMAX):
            # (the sum comes out int64: back to cur's type, which a loop must keep)
            up = tl.sum(tl.where(n[None, :] == cur[:, None], par[None, :], 0), 1).to(tl.int32)
            cur = tl.where(cur >= 0, up, cur)  # -1 past the root, -2 under a padding row
            seen = seen | (j[None, :] == cur[:, None])
        tl.store(MASK + (b * W + i[:, None]) * W + j[None, :], seen.to(tl.int64))


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
    # contiguous, so a depth's entries are `columns` apart (is_contiguous ignores the stride
    # of a size-1 dimension: a lone depth's may be anything)
    top_lp, top_ids = top_lp.contiguous(), top_ids.contiguous()
    tok = torch.empty(b, width, dtype=torch.int64, device=dev)
    pos, par = torch.empty_like(tok), torch.empty_like(tok)
    logw = torch.empty(b, width, dtype=torch.float64, device=dev)
    mask = torch.empty(b, width, width, dtype=torch.int64, device=dev)
    steps = size_bound(budget, depth, k)  # no more nodes exist: no empty steps past them
    frontier = triton.next_power_of_2(2 * steps + 1)
    table = triton.next_power_of_2(depth * columns)  # the top-k entries read
    rows = min(width, max(1, 4096 // width))  # mask rows a step of its loop takes
    small = width * rows <= 1024 and table <= 256 and frontier <= 256
    _build[(b,)](
        top_lp, top_ids, root, lens, tok, pos, par, logw, mask,
        depth * columns, columns, depth, k, steps,
        W=width, F=frontier, T=table, R=rows, DMAX=min(depth, steps) + 1,
        num_warps=1 if small else 4,
    )  # fmt: skip
    return tok, pos, par, logw, mask
