"""Attention of the static engine's forwards over the KV pool: new query rows of B requests
against each request's slot (ddserve.engine.static).

What a new token t of row b sees: the slot's committed entries [lo, past) (lo = past - window
for the windowed drafter, else 0) plus the new entries [past, past + W) it may see, which is
one of
    TREE    its ancestors in a draft tree (a [B, W, W] mask: verify),
    CAUSAL  new tokens 0..t (a prompt chunk: prefill),
    FULL    all W (the drafter's block: root + mask tokens).

Two implementations of that one rule:
  * `sdpa`    the reference: a boolean mask over a padded key range [0, ctx) (`attention_mask`,
              `fold_groups`) and torch's scaled_dot_product_attention. Runs anywhere; reads
              every one of the ctx keys of every row at full cost.
  * `triton`  one kernel (flash attention with the GQA group folded into the query rows, so
              each key is read once per kv head) that reads only the keys a row has: the loop
              over keys stops at each row's own length, read from the device, so a CUDA graph
              serves every length up to its context class (two: up to 512 keys, and the
              pool's length; the class only sets how many ways the keys may be split). Split
              over the keys ("flash decoding") when B x kv heads alone cannot fill the GPU:
              in the long class, and in the short one for tree forwards (decode, verify;
              attention_triton.split_plan), with a second small kernel merging the splits. Registered as the torch op `ddserve::tree_attention` so
              torch.compile treats it as one opaque call.

A prompt chunk whose rows all start at an empty context (a prompt's first chunk) and that runs
under a CUDA graph (engines on triton) takes `fresh` (`FRESH`, `fresh_attention`): causal self-attention over the
chunk's own keys through torch's fused kernels, nothing read from the pool (on the H200, 0.17
ms a layer for 7,200 tokens by cuDNN against 0.43-0.53 by the triton kernel: bench/NOTES.md),
so a long prompt to an idle engine goes in as one wide forward.

A prompt chunk that runs outside a CUDA graph (every chunk without graphs; on CUDA a shape not
captured at warm-up) takes a third way, `ragged` (`plan_ragged`): the rows' slots and committed
lengths are known on the host, so each row attends exactly its own keys through torch's
fused kernels (flash / cuDNN on CUDA: 1.6-3x the triton kernel's speed on prompt chunks, bench/
NOTES.md), causal from its last key (`causal_lower_right`). Registered as the torch op
`ddserve::prefill_attention` (its host lengths stay out of torch.compile's guards).

`backend("auto")` is triton on CUDA when triton imports, else sdpa. The triton kernel also runs
on CPU in triton's interpreter (TRITON_INTERPRET=1 when it is imported), which is how CI
checks it against the reference; auto never picks it there.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ddserve.errors import ConfigError

TREE, CAUSAL, FULL = 0, 1, 2


class Attn(NamedTuple):
    """One forward's attention inputs, made once and shared by every layer.
    sdpa: `mask` [B, 1, G*W, ctx] additive, keys [0, ctx). triton: `ctx` the context class
    (no row has more keys; it bounds the key splits), `past` [B] committed
    lengths, `tree` [B, W, W] (int, nonzero = visible; TREE mode only), `window` [B] or None,
    `mode` TREE / CAUSAL / FULL. ragged (CAUSAL): `past` and `slots` [B] on the host.
    fresh (CAUSAL): nothing (every row starts at an empty context)."""

    backend: str
    mask: torch.Tensor | None = None
    ctx: int = 0
    past: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    window: torch.Tensor | None = None
    mode: int = TREE
    slots: torch.Tensor | None = None


# -- the reference ------------------------------------------------------------------------


def attention_mask(lens, wpos_rel_tree, ctx: int, window=None) -> torch.Tensor:
    """Boolean [B, W, ctx]: committed entries [lo, lens) of each row plus its new tokens at
    [lens, lens+W) under the tree mask `wpos_rel_tree` [B, W, W] (lo = lens - window)."""
    b, w, _ = wpos_rel_tree.shape
    j = torch.arange(ctx, device=lens.device)
    rel = j[None, None, :] - lens[:, None, None]  # [B, 1, ctx]
    past = rel < 0
    if window is not None:
        past = past & (rel >= -window[:, None, None])
    idx = rel.clamp(0, w - 1).expand(b, w, ctx)
    tree = torch.gather(wpos_rel_tree, 2, idx) & (rel >= 0) & (rel < w)
    return past | tree


def fold_groups(mask: torch.Tensor, groups: int, dtype) -> torch.Tensor:
    """[B, W, ctx] bool -> additive bias [B, 1, G*W, ctx] (0 / -inf) in the model's dtype,
    matching the folded query rows; made once per forward, so attention does not convert a
    boolean mask in every layer."""
    b, w, ctx = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill(~mask, float("-inf"))
    return bias[:, None, None].expand(b, 1, groups, w, ctx).reshape(b, 1, groups * w, ctx)


def mode_mask(mode: int, tree: torch.Tensor | None, b: int, w: int, device) -> torch.Tensor:
    """The [B, W, W] boolean visibility among new tokens of a mode."""
    if mode == TREE:
        return tree.bool()
    full = torch.ones(b, w, w, dtype=torch.bool, device=device)
    return full.tril() if mode == CAUSAL else full


def plan(
    backend: str, past, mode: int, tree, w: int, ctx: int, groups: int, dtype, window=None
) -> Attn:
    """The per-forward attention inputs for `backend` (the sdpa mask is built once, here).
    `tree` [B, W, W] is read in TREE mode only (None otherwise)."""
    if backend == "triton":
        from ddserve.engine import attention_triton  # noqa: F401 - registers the op

        return Attn("triton", ctx=ctx, past=past, tree=tree, window=window, mode=mode)
    vis = mode_mask(mode, tree, past.shape[0], w, past.device)
    return Attn(
        "sdpa", mask=fold_groups(attention_mask(past, vis, ctx, window), groups, dtype), ctx=ctx
    )


FRESH = Attn("fresh", mode=CAUSAL)


def plan_ragged(past: torch.Tensor, slots: torch.Tensor) -> Attn:
    """A prompt chunk's attention with its rows' committed lengths and slots on the host
    (CPU int64 [B]): each row attends keys [0, past + t] of its slot, nothing padded."""
    return Attn("ragged", past=past, slots=slots, mode=CAUSAL)


@torch.library.custom_op("ddserve::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, past: torch.Tensor
) -> torch.Tensor:
    """q [B*W, nh, hd] (row r's W new tokens at positions past[r]..); kc/vc [S, kvh, L, hd]
    with the chunk's keys written; slots/past [B] on the host. Returns [B*W, nh, hd]."""
    n, nh, hd = q.shape
    b, length = slots.shape[0], kc.shape[2]
    w = n // b
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    for r, (slot, p) in enumerate(zip(slots.tolist(), past.tolist(), strict=True)):
        # a row shorter than the chunk is padded; padding past the pool's end has no keys (its
        # writes were clamped to the guard entry): only the rows with keys are attended (the
        # prompt's own tokens always are), the rest stay zero and are never read
        m = min(w, length - p)
        qr = q[r * w : r * w + m].transpose(0, 1).unsqueeze(0)  # [1, nh, m, hd]
        keys, values = kc[slot : slot + 1, :, : p + m], vc[slot : slot + 1, :, : p + m]
        out[r * w : r * w + m] = _causal_sdpa(qr, keys, values, p)[0].transpose(0, 1)
    return out


@torch.library.custom_op("ddserve::fresh_attention", mutates_args=())
def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
    """A prompt chunk of B rows that all start at an empty context: q [B*W, nh, hd], the
    chunk's own k/v [B*W, kvh, hd]; causal within each row. Returns [B*W, nh, hd]. Fixed
    shapes, no host values: it runs under CUDA graphs (a row's padding after its prompt
    sees the prompt and is never read; causal keeps it out of the prompt's rows)."""
    n, nh, hd = q.shape
    w, kvh = n // b, k.shape[1]
    att = _causal_sdpa(
        q.view(b, w, nh, hd).transpose(1, 2),
        k.view(b, w, kvh, hd).transpose(1, 2),
        v.view(b, w, kvh, hd).transpose(1, 2),
        0,
    )
    return att.transpose(1, 2).reshape(n, nh, hd)


@fresh_attention.register_fake
def _(q, k, v, b):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _causal_sdpa(q, keys, values, past: int) -> torch.Tensor:
    """q [B, nh, m, hd] of tokens at positions past..past + m - 1; keys/values [B, kvh,
    past + m, hd]: token t sees keys [0, past + t], through torch's fused kernels."""
    nh = q.shape[1]
    gqa = not (q.device.type == "cuda" and q.dtype == torch.float32)
    if not gqa:  # fp32 on CUDA: no flash/cuDNN; torch's memory-efficient kernel, which
        # takes no GQA (the math fallback would hold an m x (past + m) score matrix)
        keys = keys.repeat_interleave(nh // keys.shape[1], 1)
        values = values.repeat_interleave(nh // values.shape[1], 1)
    with _fused_kernels(q.device, first_chunk=past == 0):
        if past == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        mask = _causal_from_end(q.shape[2], past, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


@prefill_attention.register_fake
def _(q, kc, vc, slots, past):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _causal_from_end(m: int, past: int, device: torch.device):
    """Token t of m new ones sees keys [0, past + t]. On CUDA torch's lower-right causal
    bias (its fused kernels take it); elsewhere the boolean mask (imported lazily: torch's
    attention-bias module imports triton, which CI's interpreted kernels must import first)."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(m, past + m)
    return torch.ones(m, past + m, dtype=torch.bool, device=device).tril(past)


def _fused_kernels(device: torch.device, first_chunk: bool):
    """On CUDA, torch's fused kernels first, in the order measured fastest on the H200
    (bench.prefill_attention): cuDNN for a whole prompt from its start, flash for a chunk
    after committed keys; then the memory-efficient kernel (fp32), math last. Elsewhere
    torch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    order = (fused if first_chunk else fused[::-1]) + [
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


def attend(
    q, kc, vc, rows, b: int, w: int, attn: Attn, rows_are_slots: bool, k=None, v=None
) -> torch.Tensor:
    """q [B*W, nh, hd] (RoPE applied); kc/vc one layer's pool [S, kvh, L, hd] with this
    forward's keys already written; rows [B] slots; k/v [B*W, kvh, hd] this forward's own
    keys and values (read by `fresh` only). Returns [B*W, nh*hd]."""
    n, nh, hd = q.shape
    kvh = kc.shape[1]
    if attn.backend == "fresh":
        if k is None or v is None:  # (the fused layers write their keys in-kernel)
            raise ValueError("fresh attention needs the forward's own keys and values")
        return torch.ops.ddserve.fresh_attention(q, k, v, b).view(n, nh * hd)
    if attn.backend == "ragged":
        out = torch.ops.ddserve.prefill_attention(q, kc, vc, attn.slots, attn.past)
        return out.view(n, nh * hd)
    if attn.backend == "triton":
        out = torch.ops.ddserve.tree_attention(
            q, kc, vc, rows, attn.past, attn.tree, attn.window, w, attn.mode, attn.ctx
        )
        return out.view(n, nh * hd)
    g, ctx = nh // kvh, attn.ctx
    if rows_are_slots:
        keys, values = kc[:b, :, :ctx], vc[:b, :, :ctx]
    else:
        keys, values = kc.index_select(0, rows)[:, :, :ctx], vc.index_select(0, rows)[:, :, :ctx]
    qg = q.reshape(b, w, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * w, hd)
    att = F.scaled_dot_product_attention(qg, keys, values, attn_mask=attn.mask)
    return att.view(b, kvh, g, w, hd).permute(0, 3, 1, 2, 4).reshape(n, nh * hd)


def backend(name: str, device: torch.device) -> str:
    """auto -> triton on CUDA when it imports, else sdpa. An explicit `triton` off CUDA runs
    only under TRITON_INTERPRET=1 (the tests); without triton it is a config error."""
    if name == "sdpa":
        return "sdpa"
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if cuda and _triton_imports() else "sdpa"
    if not (cuda or os.environ.get("TRITON_INTERPRET") == "1") or not _triton_imports():
        raise ConfigError(
            "attention_backend=triton needs the triton package and a CUDA device; "
            "use --attention-backend sdpa (or auto)"
        )
    return "triton"


def _triton_imports() -> bool:
    try:
        from ddserve.engine import attention_triton  # noqa: F401 - registers the op
    except ImportError:
        return False
    return True
