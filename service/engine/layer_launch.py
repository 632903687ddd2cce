"""How the fused layer's kernels (ddserve.engine.layer_triton) launch: their launch
parameters per kernel and row class (DEFAULTS, measured; TUNE, benchmarks' overrides), which
forwards take them at all (FUSED_MAX_ROWS), and which overlap their chain on Hopper (PDL, the
L2 prefetches). Module state that benchmarks and tests set: PDL, PREFETCH, TUNE,
FUSED_MAX_ROWS, OVERLAP_*. Imported only where triton is."""

from __future__ import annotations

import torch

from ddserve.engine.static import next_bucket
from ddserve.engine.triton_hopper import bulk_aligned, hopper

# wider forwards go through torch: measured on the H200 (bench/NOTES.md), the fused layer
# wins up to 16 rows (32.8 vs 34.8 us per layer at 1 row) and ties at 64 (41.8 vs 41.6)
FUSED_MAX_ROWS = 16


def rows_key(m: int) -> int:
    """The row class a forward of m rows takes its launch parameters from: m rounded up to
    a power of two (1, 2, 4, ..., 64)."""
    return next_bucket(m, 1, 64)


# the most rows a GEMV program takes (a forward of more runs several row blocks; no default
# set of today has GEMV at more than 8 rows). At 16 rows the GEMV sets lost 3-5x to tensor
# cores in 16-row blocks; in two blocks of 8 qkv took 6.82 us against 8.43 on tensor cores
# (gate/up, o, down still lost: 23.4 / 8.0 / 11.1 against 7.7 / 2.5 / 3.8), a 16-slot layer
# 32.80 against 35.23 us without overlap (an H100, results/verify-attention/last/
# lk-16-gemv8.json, `bench.layer_kernels --gemv-block-rows`). Not in DEFAULTS yet: a GEMV
# qkv turns the overlap off for the 16-row forwards of 1-4 slots (OVERLAP_MAX_GEMV_ROWS),
# which gave one request's 16-row verify ~4%; a verify step of each is for the next lease
GEMV_BLOCK_ROWS = 8


def block_m(m: int, block_n: int) -> int:
    """Rows a program takes: tensor-core tiles take 16, 32 or 64; GEMV blocks (block_n < 16)
    the forward's rows up to GEMV_BLOCK_ROWS (a 1-row forward computes no padding rows)."""
    return next_bucket(m, 1, GEMV_BLOCK_ROWS) if block_n < 16 else next_bucket(m, 16, 64)


# Launch parameters per kernel and row class: (block_n, block_k, num_warps, num_stages);
# qkv's block_n is the rotary columns per half a program takes (0: the whole half); a
# block_n under 16 multiplies on the CUDA cores (GEMV in _mac), 16 and over on tensor cores.
# Measured per kernel with `python -m ddserve.bench.layer_kernels` (SmolLM2's shapes; the
# 16- and 64-row sets on an H200, the GEMV ones on an H100); TUNE overrides (benchmarks). A
# row class without an entry takes the next larger class's (launch_params).
DEFAULTS = {
    # 1-8 rows: GEMV sets (an H100, results/kernels-gemv/: lk-gemv.json, lk-gemv24.json,
    # lk-gemv8.json), a layer against the 16-row sets: 1 row 20.09 / 30.61 us, 2 rows 21.71 /
    # 32.01, 4 rows 26.02 / 31.42 (o and down keep tensor cores), 8 rows 30.61 / 33.63 (qkv
    # alone on GEMV)
    ("qkv", 1): (2, 1024, 2, 1),
    ("gate_up", 1): (4, 1024, 2, 1),
    ("o", 1): (4, 1024, 2, 1),
    ("down", 1): (4, 2048, 2, 1),
    ("qkv", 2): (2, 1024, 2, 1),
    ("gate_up", 2): (4, 1024, 2, 1),
    ("o", 2): (4, 1024, 4, 1),
    ("down", 2): (4, 2048, 4, 1),
    ("qkv", 4): (2, 1024, 2, 1),
    ("gate_up", 4): (4, 1024, 2, 1),
    ("o", 4): (16, 128, 4, 3),
    ("down", 4): (16, 512, 4, 3),
    ("qkv", 8): (2, 1024, 4, 1),
    ("gate_up", 8): (32, 256, 4, 1),
    ("o", 8): (16, 128, 4, 3),
    ("down", 8): (16, 512, 4, 3),
    # 16 rows: with PDL and the L2 prefetches (results/pdl-h200/lk1.json)
    ("qkv", 16): (0, 256, 8, 1),
    ("gate_up", 16): (32, 256, 4, 1),
    ("o", 16): (16, 128, 4, 3),
    ("down", 16): (16, 512, 4, 3),
    ("qkv", 64): (0, 256, 8, 1),
    ("gate_up", 64): (16, 256, 8, 1),
    ("o", 64): (16, 128, 4, 3),
    ("down", 64): (16, 256, 4, 3),
}
TUNE: dict[tuple[str, int], tuple[int, int, int, int]] = {}

# Split-K (ddserve.engine.layer_split): per kernel and row class (rows_key, exactly), the
# programs a tile's K loop is spread over (at most: whole block_k steps each); a class
# without an entry is unsplit. SPLIT_K overrides (benchmarks: bench.tuned's "split_k").
# Measured on an H100 (bench/results/layer-split/h100/, random SmolLM2, 256 keys, the
# 16-row default sets: qkv, gate/up and down 3 block_k steps, o 5), verify steps of 16 rows
# unsplit -> 3 splits of all four: B=1 x W=16 1.069 -> 0.866 ms, 2 x 8 1.055 -> 0.861, 4 x 4
# 1.056 -> 0.887, 16 x 1 1.171 -> 1.005. Each kernel alone (`bench.layer_kernels --splits`,
# results/layer-split/h100/s29/lk-split.json) then said o and down lose split (16 rows: 2.40
# -> 2.83 us, 3.78 -> 4.57; they have 36 tiles) where qkv and gate/up gain (8.38 -> 4.59,
# 7.61 -> 5.37), and gate/up gains at 8 rows too (8.53 -> 6.23): as verify steps, against
# all four split at 16 rows, B=1 x W=8 0.991 -> 0.912 ms, 1 x 16 0.853 -> 0.829, 2 x 8 0.867
# -> 0.843 (steps-lk.json)
SPLIT_K_DEFAULTS = {("qkv", 16): 3, ("gate_up", 16): 3, ("gate_up", 8): 3}
SPLIT_K: dict[tuple[str, int], int] = {}

# Hopper and later. PDL, programmatic dependent launch: each kernel lets the next one start
# as it starts, and the next one waits for it only before it reads activations, so a chain
# of small kernels overlaps its launches. PREFETCH: a program first has its weight rows
# prefetched into L2 (all of them at once, before that wait), so its K loop waits on L2,
# not on memory. None: where they run (CUDA, compute capability >= 9) and pay: forwards in
# context classes up to OVERLAP_MAX_CTX keys (on the H200, bench/NOTES.md "Eleventh
# session": a verify step at 256 keys 0.93-0.99x of plain launches for 1-4 requests, 0.98-
# 1.02x for 16; at 4,096 keys 0.92-1.08x, four shapes of six above 1); True / False:
# benchmarks' side-by-side switches.
# OVERLAP_AUTO: None's answer. Off in the twelfth session, when the GPU test of the chain
# (twelve layers under a graph, PDL + prefetch against serial launches, inputs varying per
# replay, cos/sin made in the graph, the split merge) did not give the same bits on the H200;
# the cause was the test's warm-up (every write position 0: a row's two tokens stored their
# keys to one position, the winning store undefined). With a real warm-up (thirteenth
# session, H200): the GPU tests passed (56) and `python -m ddserve.bench.pdl_check` gave equal
# bits in all 16 runs (serial, PDL, prefetch, both x zero/real warm-up x fixed cos x same
# inputs); verify steps at 256 keys, fused with overlap against without: 1 request 0.95x
# (width 1) / 0.96x (16), 4 requests 0.96x / 1.00x, 16 requests 1.05x / 1.00x.
PDL: bool | None = None
PREFETCH: bool | None = None
OVERLAP_AUTO = True
OVERLAP_MAX_CTX = 512
# at 16 slots of 1 row the overlapped step was slower in two leases (1.214 vs 1.159 ms, 1.224
# vs 1.168): on for 1-4 slots (measured faster), off above (8 not measured)
OVERLAP_MAX_BATCH = 4
# a forward of more rows than this whose kernels take GEMV sets does not overlap: on the H100
# a layer of GEMV qkv and gate/up at 4 rows took 32.09 us overlapped against 27.25 plain (at
# 1 row 20.09 against 20.89: on). Likely: the early-launched programs of a wide GEMV grid
# hold SMs (and registers) the running kernel's programs would take; not profiled
OVERLAP_MAX_GEMV_ROWS = 1
KERNELS = ("qkv", "gate_up", "o", "down")


def launch_params(kernel: str, m: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of `kernel` for a forward of m rows: TUNE's
    for its row class or, without one, the next larger class it has up to the tile class (16
    or 64 rows); else DEFAULTS' the same way."""
    key = rows_key(m)
    tile = 16 if key <= 16 else 64
    for table in (TUNE, DEFAULTS):
        k = key
        while k <= tile:
            if (kernel, k) in table:
                return table[(kernel, k)]
            k *= 2
    return DEFAULTS[(kernel, tile)]  # unreachable: DEFAULTS holds both tile classes


def split_k(kernel: str, m: int) -> int:
    """The programs each output tile of `kernel` spreads its K loop over, for m rows:
    SPLIT_K's for its row class, else SPLIT_K_DEFAULTS', else 1."""
    key = (kernel, rows_key(m))
    return SPLIT_K.get(key, SPLIT_K_DEFAULTS.get(key, 1))


def pdl_on(device: torch.device, ctx: int = 0, batch: int = 1, rows: int = 1) -> bool:
    """Whether a forward of `batch` slots and `rows` rows in context class `ctx` (0: short)
    launches its chain with PDL."""
    if PDL is not None:
        return PDL
    return _overlap_auto(device, ctx, batch, rows)


def gemv(m: int) -> bool:
    """Whether a forward of m rows runs any layer kernel with a GEMV set."""
    return any(0 < launch_params(k, m)[0] < 16 for k in KERNELS)


def _overlap_auto(device: torch.device, ctx: int, batch: int, rows: int) -> bool:
    return (
        OVERLAP_AUTO
        and hopper(device)
        and ctx <= OVERLAP_MAX_CTX
        and batch <= OVERLAP_MAX_BATCH
        and (rows <= OVERLAP_MAX_GEMV_ROWS or not gemv(rows))
    )


def prefetch_on(device: torch.device, ctx: int = 0, batch: int = 1, rows: int = 1) -> bool:
    """Whether a forward of `batch` slots and `rows` rows in context class `ctx` (0: short)
    prefetches weights and keys."""
    if PREFETCH is not None:
        return PREFETCH
    return _overlap_auto(device, ctx, batch, rows)


def prefetch_bytes(w: torch.Tensor, ctx: int, batch: int, rows: int) -> int:
    """The bytes of each of w's rows to prefetch into L2 (0: none): a row, where every row
    starts 16-byte aligned (the bulk prefetch's rule), rounded down to 16 bytes."""
    on = prefetch_on(w.device, ctx, batch, rows)
    if not on or w.stride(1) != 1 or not bulk_aligned(w, (0,)):
        return 0
    return w.shape[1] * w.element_size() // 16 * 16
