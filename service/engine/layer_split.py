"""Split-K for the fused layer's projections (ddserve.engine.layer_triton): a tile's K loop
spread over SPLIT programs, the last of them to arrive finishing the tile. Imported only
where triton is.

At 16 rows a projection's tensor-core tiles give SmolLM2's qkv 15 programs, o and down 36,
gate/up 48 on 132 SMs, each walking the whole input; a 16-row verify step spends ~26 us a
layer in them (bench/NOTES.md, twenty-third session). Split, each program walks a
SPLIT-th of the input and parks its fp32 partial sums (and, for the kernels with the norm
folded in, its partial sum of x^2) in a workspace; then it counts itself in on the tile's
arrival counter. The program that arrives last sums the SPLIT partials in split order (so
the result does not depend on which program finishes: the same bits at every run), resets
the counter to zero for the next kernel and runs the kernel's epilogue (norm scale, RoPE
and the K/V writes, SiLU x up, the residual). No second kernel, so CUDA graphs replay it
as they replay one launch, and the PDL chain keeps its links. How many programs:
layer_launch.split_k (3 for the 16-row class: verify steps of 9-16 rows 14-19% faster on an
H100, bench/NOTES.md "Twenty-fifth session").

The workspace and counters are shared by every split kernel run on one stream: kernels of
a stream run one after another (with PDL, each touches them only after `wait_prev`, when
its predecessor, whose finishers reset their counters, has completed). Forwards on two
streams (a prompt chunk beside a step, graph lanes) get their own (`workspace`, keyed by
the stream a forward is issued or captured on). A workspace, once made, is never freed: a
graph captured with it keeps its address. The engine's graphs (graphs.GraphCache) run a
forward eagerly on their capture stream before capturing it, so the workspace is made there,
outside any capture: made inside one, it would come from the graph pool the lane's graphs
share, possibly from memory an earlier graph uses as scratch, whose every replay would then
overwrite the counters (on an H100 that ended requests with non-finite logits where verify
widths changed round by round: bench/NOTES.md, twenty-eighth session). One a capture makes
anyway (a caller without that warm-up) has its counters zeroed by that graph at each
replay; should that capture fail, the next forward outside a capture zeroes them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the workspace's fp32 elements at least (4 MB), and its tile counters
MIN_FLOATS = 1 << 20
COUNTERS = 4096
_SPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_KEEP: list[tuple[torch.Tensor, torch.Tensor]] = []
_CAPTURED: set[tuple] = set()  # keys whose counters only a captured graph has zeroed


def workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials of at least `floats` elements, int32 counters of at least `tiles`,
    zero) for split kernels issued on the current stream of `device`."""
    cuda = device.type == "cuda"
    stream = torch.cuda.current_stream(device).cuda_stream if cuda else 0
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    key = (str(device), stream)
    have = _SPACES.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < tiles:
        have = (
            torch.empty(max(floats, MIN_FLOATS), device=device, dtype=torch.float32),
            torch.zeros(max(tiles, COUNTERS), device=device, dtype=torch.int32),
        )
        _SPACES[key] = have
        _KEEP.append(have)  # never freed: graphs captured with an older one keep using it
        if capturing:
            _CAPTURED.add(key)
    elif key in _CAPTURED and not capturing:
        have[1].zero_()
        _CAPTURED.discard(key)
    return have


@triton.jit
def k_range(K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """This program's input columns [lo, hi): its split's share of whole BLOCK_K steps
    (unsplit: 0 and K as they were, a loop from a constant)."""
    lo = 0
    hi = K
    if SPLIT > 1:
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        lo = tl.program_id(2) * per
        hi = tl.minimum(lo + per, K)
    return lo, hi


@triton.jit
def _park2(WS, at, x, BM: tl.constexpr, BN: tl.constexpr):
    """x [BM, BN] (fp32) into WS at element `at`."""
    r = tl.arange(0, BM)
    c = tl.arange(0, BN)
    tl.store(WS + at + r[:, None] * BN + c[None, :], x)


@triton.jit
def _park1(WS, at, x, BM: tl.constexpr):
    tl.store(WS + at + tl.arange(0, BM), x)


@triton.jit
def _sum2(WS, at, stride, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The SPLIT partials [BM, BN] parked at `at + s * stride`, summed in split order."""
    r = tl.arange(0, BM)
    c = tl.arange(0, BN)
    off = WS + at + r[:, None] * BN + c[None, :]
    acc = tl.load(off, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(off + s * stride, cache_modifier=".cg")
    return acc


@triton.jit
def _sum1(WS, at, stride, SPLIT: tl.constexpr, BM: tl.constexpr):
    off = WS + at + tl.arange(0, BM)
    acc = tl.load(off, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(off + s * stride, cache_modifier=".cg")
    return acc


@triton.jit
def arrive(Cnt, tile, SPLIT):
    """Count this program in on `tile`'s counter, after every thread's partials are stored;
    whether it is the last (which then resets the counter and finishes the tile). acq_rel:
    the partials stored before are released with the count, and the last one's loads after
    acquire every other program's."""
    tl.debug_barrier()  # all the program's stores before its one count
    old = tl.atomic_add(Cnt + tile, 1, sem="acq_rel", scope="gpu")
    last = old == SPLIT - 1
    if last:
        tl.store(Cnt + tile, 0)
    tl.debug_barrier()
    return last


@triton.jit
def share_bytes(PREFETCH: tl.constexpr, k_lo, k_hi, ES: tl.constexpr, SPLIT: tl.constexpr):
    """The bytes of each weight row this program prefetches from its columns k_lo on: its
    share of the PREFETCH bytes of a row (a multiple of 16; the launcher makes every share
    16-byte aligned and at least 16 bytes)."""
    if SPLIT > 1:
        return tl.minimum((k_hi - k_lo) * ES, PREFETCH - k_lo * ES) // 16 * 16
    return PREFETCH


@triton.jit
def reduce2(WS, Cnt, a, b, ss, tile, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Two accumulators [BM, BN] and the rows' sums of x^2 [BM] of a split program: parked,
    counted in; the tile's totals (meaningful in the last program only) and whether this is
    the last."""
    part: tl.constexpr = 2 * BM * BN + BM
    at = (tile * SPLIT + tl.program_id(2)) * part
    _park2(WS, at, a, BM, BN)
    _park2(WS, at + BM * BN, b, BM, BN)
    _park1(WS, at + 2 * BM * BN, ss, BM)
    last = arrive(Cnt, tile, SPLIT)
    if last:
        base = tile * SPLIT * part
        a = _sum2(WS, base, part, SPLIT, BM, BN)
        b = _sum2(WS, base + BM * BN, part, SPLIT, BM, BN)
        ss = _sum1(WS, base + 2 * BM * BN, part, SPLIT, BM)
    return a, b, ss, last


@triton.jit
def reduce1(WS, Cnt, a, tile, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One accumulator's reduce2."""
    part: tl.constexpr = BM * BN
    _park2(WS, (tile * SPLIT + tl.program_id(2)) * part, a, BM, BN)
    last = arrive(Cnt, tile, SPLIT)
    if last:
        a = _sum2(WS, tile * SPLIT * part, part, SPLIT, BM, BN)
    return a, last


def plan(k: int, block_k: int, splits: int, row_bytes: int, es: int) -> tuple[int, bool]:
    """(the splits a launch takes: at most `splits`, every one a nonempty run of whole
    block_k steps; whether each one's share of a weight row prefetches: 16-byte aligned and
    at least 16 bytes, `row_bytes` being what a row prefetches whole)."""
    steps = triton.cdiv(k, block_k)
    per = triton.cdiv(steps, max(1, min(splits, steps)))
    n = triton.cdiv(steps, per)
    if n == 1:
        return 1, True
    last = min(k * es, row_bytes) - (n - 1) * per * block_k * es
    return n, per * block_k * es % 16 == 0 and last >= 16


def floats(tiles: int, splits: int, bm: int, bn: int, accs: int) -> int:
    """The workspace a launch's partials take: `accs` accumulators (and, with two, the
    rows' sums of x^2) per tile and split."""
    return tiles * splits * (accs * bm * bn + (bm if accs == 2 else 0))


def launch_split(splits, w, k, tiles, bm, bn, bk, accs, prefetch):
    """A layer kernel's split-K for its launch: (SPLIT, the workspace, the tile counters,
    PREFETCH). `splits` what layer_launch.split_k asks, w the kernel's weight, k its input
    width, `tiles` its output tiles of bm x bn, `accs` its accumulators, `prefetch` a
    weight row's bytes to prefetch whole. SPLIT 1 where none is asked or the input is one
    block_k step (no workspace: the kernels never touch it unsplit)."""
    split, aligned = plan(k, bk, splits, prefetch, w.element_size())
    if split == 1:
        return 1, w, w, prefetch
    ws, cnt = workspace(w.device, floats(tiles, split, bm, bn, accs), tiles)
    return split, ws, cnt, prefetch if aligned else 0
