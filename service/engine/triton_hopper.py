"""Hopper's (compute capability 9+) means of overlapping a chain of small kernels, shared by
the engine's triton kernels (ddserve.engine.layer_triton, ddserve.engine.attention_triton).
Imported only where triton is.

* Programmatic dependent launch (PDL): a kernel launched with `launch_pdl=True` may start
  while its predecessor in the stream still runs, once every program of the predecessor has
  called `launch_next` (or exited: a kernel that never calls it, torch's, triggers as its
  programs exit, before its writes are guaranteed visible). It must call `wait_prev` before
  it reads anything a kernel of the stream may have written since the work before the
  chain's first kernel (host copies are fine), and before it writes anything at all.
  Completion is transitive: a kernel past `wait_prev` knows every earlier kernel finished.
* `prefetch_l2`: a bulk prefetch of memory into L2 (cp.async.bulk.prefetch): no registers
  held, nothing waited for; issued before `wait_prev` for what no predecessor writes
  (weights, committed keys), so the loads after the wait find it in L2.

On CPU (triton's interpreter: the tests) none of this runs: the kernels take PDL and the
prefetch sizes as constexprs that are off there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait in `wait_prev` for this one)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prev(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(at, nbytes):
    """Each address of `at` (16-byte aligned) and the `nbytes` after it (a multiple of 16,
    > 0) into L2. Each warp issues one bulk prefetch per distinct address it holds (a loop
    over them); a layout that replicates elements across warps repeats some, which the L2
    absorbs (a scalar address: one per warp)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [at, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def hopper(device: torch.device) -> bool:
    """Whether `device` runs PDL and bulk prefetches (CUDA, compute capability >= 9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def bulk_aligned(t: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether every row of `t` along `dims` starts 16-byte aligned (prefetch_l2's rule):
    its data pointer and those dimensions' strides in bytes are multiples of 16."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(t.stride(d) * size % 16 == 0 for d in dims)


def launch_kwargs(pdl: bool) -> dict:
    """The launch options of a kernel in a PDL chain (none off it)."""
    return {"launch_pdl": True} if pdl else {}
