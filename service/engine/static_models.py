"""The target as a fixed-shape forward over a KV pool (ddserve.engine.static; the DFlash
drafter's: ddserve.engine.static_dflash), the forwards' compiled glue, the pool's size.

Each call takes its integer inputs packed in one host tensor (one host->device copy), runs
under a CUDA graph keyed by its shape when graphs are on, and returns output tensors that the
next call of the same shape overwrites: read them before that.

Target inputs per row (B rows x W new tokens): tokens, RoPE positions, write positions (where
each token's key/value goes; rows that only fill the shape write into the slot's guard
entries), committed length (the mask's past), slot, and the [W, W] tree mask. Outputs: logits
[B*W, V] float32, [2, B*W] (argmax, all-finite flag), tapped layer outputs [B*W, taps*H];
a prefill forward (rows named by slot index, causal) returns only the tapped outputs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ddserve.config.engine import MAX_BUDGET
from ddserve.engine.attention import CAUSAL, FRESH, TREE, plan, plan_ragged
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.graphs import GraphCache
from ddserve.engine.llama import Llama, linear
from ddserve.engine.static import (
    KVPool,
    Staging,
    fit_slots,
    fuse_weights,
    kv_step,
    layer_step,
    next_bucket,
)
from ddserve.errors import EngineError

log = logging.getLogger(__name__)

# scratch entries at the end of every slot: the widest forward (a tree of MAX_BUDGET nodes
# plus its root, rounded up to a power of two) writes its padding there
GUARD = next_bucket(MAX_BUDGET + 1, 256, 1 << 20)


# the context class of a prompt chunk whose rows all start at an empty context (a prompt's
# first chunk): its attention is the chunk's own causal self-attention (attention.FRESH)
FRESH_CTX = 0


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pool_length(max_context: int, guard: int = GUARD) -> int:
    """Entries per KV slot: the context plus the guard, rounded up to 64."""
    return round_up(max_context + guard, 64)


class StaticTarget:
    """The target model's forward over a KV pool with one slot per request."""

    def __init__(
        self,
        model: Llama,
        slots: int,
        max_context: int,
        capture: tuple[int, ...],
        graphs: bool,
        guard: int = GUARD,
        layer_fn=layer_step,
        attention: str = "sdpa",
        compiled: bool = False,
    ):
        self.model = model
        self.layer = layer_fn  # layer_step, or the engine's compiled version of it
        # the verify's head (final norm, LM head, argmax and the finite flag) in a few
        # kernels where the engine compiles (glue_compiled)
        self.head = glue_compiled(self._head, compiled)
        # a prompt chunk outside a graph runs the plain layer: a compiled one meets new
        # (rows, width) with a guard to fail (dynamic shapes still specialise on ranges and
        # on sizes equal to the model's) and recompiles for seconds while others wait; on
        # the H200 such prefills also took a flat ~37 ms from 1,000 to 7,200 tokens
        # (host-bound, cause not profiled: bench/NOTES.md)
        self.prefill_layer = layer_step
        self.attention = attention  # "sdpa" | "triton" (ddserve.engine.attention)
        for block in model.layers:
            fuse_weights(block)
        cfg = model.cfg
        self.pool = KVPool(
            cfg,
            cfg.num_layers,
            slots,
            pool_length(max_context, guard),
            guard,
            model.device,
            model.dtype,
        )
        self.capture = capture
        # lane 1: prompt chunks (they may run beside a decode step: StaticEngine.prefill_batch)
        self.graphs = GraphCache(graphs, "target", lanes=2)
        # prompt chunks of shapes not captured yet: captured on first use (True), or run
        # without a graph (False, once the engine's warm-up captured what it captures: a
        # capture while others decode stalled them ~0.2-0.4 s on the H200, bench/NOTES.md)
        self.capture_prefill = True
        self.inputs: dict[tuple, torch.Tensor] = {}
        self.staging = Staging()

    def ctx_bucket(self, longest: int) -> int:
        """Keys attended per row, as the class of a forward's shape (a graph per class).
        sdpa reads that padded range: a power of two >= the longest committed + new entries.
        The triton kernel reads each row's own keys; for it the class only bounds the key
        splits, and there are two: up to 512 keys (splits of >= 64 keys for decode-shaped
        trees, else one) and the pool's length (splits by the shape), so the warm-up
        captures every graph a forward can need (`classes`). With a class per power of two,
        the first forward past each one was captured, and compiled, while serving: ~2 s that
        every stream waited on the H200, and prompt chunks beyond 512 keys ran without
        graphs, ~25-60 ms of launches each whatever their width (bench/NOTES.md)."""
        ml = self.pool.max_len
        if self.attention == "triton":
            return min(512, ml) if longest <= 512 else ml
        return next_bucket(longest, 128, ml)

    def classes(self, contexts) -> list[int]:
        """The context classes the warm-up captures: triton's two, or sdpa's of `contexts`."""
        if self.attention == "triton":
            contexts = (1, self.pool.max_len)
        return sorted({self.ctx_bucket(c) for c in contexts})

    @torch.inference_mode()
    def forward(
        self, packed: np.ndarray, b: int, w: int, ctx: int, rows_are_slots: bool, trees=None
    ):
        """`trees`: (tokens, positions [B, W], mask [B, W, W]) on the device, built there
        (static_dflash.StaticDFlash): they replace the packed ones, device to device, with no sync (the
        packed inputs then stop before the tree mask: pack_target without one)."""
        key = (rows_are_slots, b, w, ctx)
        if not rows_are_slots and self.prefill_eager(key):
            return self._prefill_eager(packed, key)
        inp = self.buffer(key)
        self.staging.copy(inp, packed)
        if trees is not None:
            n = b * w
            tok, pos, mask = trees
            inp[:n].copy_(tok.view(-1))
            inp[n : 2 * n].copy_(pos.view(-1))
            inp[3 * n + 2 * b :].copy_(mask.view(-1))
        return self.graphs.run(key, lambda: self._forward(inp, key), lane=int(not rows_are_slots))

    def buffer(self, key: tuple) -> torch.Tensor:
        """The integer inputs of the forward of shape `key`, in pack_target's layout."""
        inp = self.inputs.get(key)
        if inp is None:
            rows_are_slots, b, w, _ = key
            n = b * w
            size = 3 * n + 2 * b + (n * w if rows_are_slots else 0)  # pack_target's layout
            inp = self.inputs[key] = torch.zeros(size, dtype=torch.long, device=self.model.device)
        return inp

    def replay(self, key: tuple):
        """A verify of shape `key` from inputs already written on the device (`buffer`:
        ddserve.engine.static_spec fills them there)."""
        inp = self.buffer(key)
        return self.graphs.run(key, lambda: self._forward(inp, key))

    def forward_next(self, key: tuple, tokens: torch.Tensor):
        """The last decode forward of shape `key` (one token a row) once more, one position
        on, from the device alone (ddserve.engine.static_steps): each row's token from
        `tokens` [B]; rows that write real entries (below the guard) move their position,
        write position and length one on, rows that only fill the shape keep writing their
        guard entry."""
        _, b, w, _ = key
        if w != 1:
            raise EngineError(f"forward_next steps one-token forwards, not width {w}")
        inp = self.inputs[key]
        live = (inp[2 * b : 3 * b] < self.pool.usable).long()
        inp[b : 4 * b].view(3, b).add_(live)
        inp[:b].copy_(tokens)
        return self.graphs.run(key, lambda: self._forward(inp, key))

    def prefill_eager(self, key: tuple) -> bool:
        """Whether a prompt chunk of this shape runs without a CUDA graph (then of any width
        and row count: nothing padded, `plan_ragged` attention)."""
        return not self.graphs.enabled or (
            not self.capture_prefill and key not in self.graphs.graphs
        )

    def _prefill_eager(self, packed: np.ndarray, key: tuple):
        _, b, w, _ = key
        n = b * w
        host = torch.from_numpy(packed[3 * n : 3 * n + 2 * b].astype(np.int64))  # lengths, slots
        inp = torch.from_numpy(packed).to(self.model.device, non_blocking=False)
        return self._forward(inp, key, ragged=plan_ragged(host[:b], host[b:]))

    def _forward(self, inp: torch.Tensor, key: tuple, ragged=None):
        rows_are_slots, b, w, ctx = key
        m, n = self.model, b * w
        tok, pos, wpos = (inp[i * n : (i + 1) * n] for i in range(3))
        lens, rows = inp[3 * n : 3 * n + b], inp[3 * n + b : 3 * n + 2 * b]
        # int, nonzero = visible; prefill (causal) packs none
        tree = inp[3 * n + 2 * b :].view(b, w, w) if rows_are_slots else None
        wpos = wpos.view(b, w)
        # tok/pos: [B*W]  wpos: [B, W]  lens/rows: [B]  tree: [B, W, W]
        x = m.embed_tokens(tok)  # [B*W, H]
        cos, sin = m.rope(pos)
        groups = m.cfg.num_heads // m.cfg.num_kv_heads
        # rows named by slot index are prompt chunks (prefill: causal); rows = slots verify trees
        mode = TREE if rows_are_slots else CAUSAL
        if ragged is not None:
            attn = ragged
        elif ctx == FRESH_CTX and not rows_are_slots:
            attn = FRESH
        else:
            attn = plan(self.attention, lens, mode, tree, w, ctx, groups, x.dtype)
        taps = []
        layer = self.layer if ragged is None else self.prefill_layer
        last = len(m.layers) - 1
        for i, block in enumerate(m.layers):
            if i == last and not rows_are_slots and i not in self.capture:
                # a prompt chunk's last layer: only its keys and values are read later
                kv_step(block, x, cos, sin, self.pool.k[i], self.pool.v[i], rows, wpos)
                break
            x = layer(
                block,
                x,
                cos,
                sin,
                self.pool.k[i],
                self.pool.v[i],
                rows,
                wpos,
                attn,
                rows_are_slots,
            )
            if i in self.capture:
                taps.append(x)
        taps = torch.cat(taps, dim=-1) if taps else None
        if not rows_are_slots:  # prefill: no logits (the prompt's last token is verified later)
            return None, None, taps
        logits, top = self.head(x)
        return logits, top, taps

    def _head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, V] float32 of the last layer's outputs x [N, H], and [2, N]: each row's
        argmax and whether all its logits are finite."""
        m = self.model
        logits = linear(m.norm(x), m.lm_head.weight).float()
        top = torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()])
        return logits, top


def pack_target(tokens, pos, wpos, lens, rows, tree=None) -> np.ndarray:
    """[B, W] tokens, positions, write positions; [B] lengths, slots; [B, W, W] tree mask (a
    verify's; a prefill is causal and packs none) -> one int64 vector (one host->device copy)."""
    parts = [tokens.ravel(), pos.ravel(), wpos.ravel(), lens, rows]
    if tree is not None:
        parts.append(tree.ravel().astype(np.int64))
    return np.concatenate(parts)


# whether glue_compiled compiles (benchmarks' switch: `bench.tuned` {"engine":
# {"COMPILE_GLUE": false}} runs the glue eagerly, as before 2026-12-06)
COMPILE_GLUE = True


def glue_compiled(fn, compiled: bool):
    """`fn` (a forward's glue between its layers: norms, RoPE angles, embeddings, heads; pure
    functions of their inputs) through torch.compile where the engine compiles (a GPU): under
    a CUDA graph each of its small eager kernels costs ~2-3 us of the step; inductor fuses
    them into a few. dynamic=True: one compilation serves every batch and width. If the
    compiled function fails outside a graph capture (the first calls, in the warm-up, compile
    it), the glue runs eagerly from then on (logged): slower, never down."""
    if not (compiled and COMPILE_GLUE):
        return fn
    use = [torch.compile(fn, dynamic=True)]

    def glue(*args, **kwargs):
        f = use[0]
        if f is fn:
            return fn(*args, **kwargs)
        try:
            return f(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a compiler failure: the eager glue
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            log.warning("compiled %s failed (%s); it runs eagerly", fn.__name__, exc)
            use[0] = fn
            return fn(*args, **kwargs)

    return glue


def slots_that_fit(model, drafter, slots: int, max_context: int, fraction: float) -> int:
    """The KV slots (target's pool + the DFlash drafter's) that fit in the GPU's memory;
    fewer than asked is logged."""
    max_len = pool_length(max_context)
    per_slot = KVPool.slot_bytes(model.cfg, model.cfg.num_layers, max_len, model.dtype)
    if isinstance(drafter, DFlashDrafter):  # its pool has the target's slots and length
        c = drafter.net.c
        per_slot += KVPool.slot_bytes(c, c.num_layers, max_len, model.dtype)
    free, total = torch.cuda.mem_get_info(model.device)
    n = fit_slots(slots, per_slot, free, total, fraction)
    if n < slots:
        log.warning(
            "KV pool: %d of %d slots fit (%.2f GiB each at max_context=%d, "
            "gpu_memory_utilization=%g); more requests wait for a free slot",
            n, slots, per_slot / (1 << 30), max_context, fraction,
        )  # fmt: skip
    return n
