"""The target and the DFlash drafter as fixed-shape forwards over KV pools (ddserve.engine.static).

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
from ddserve.engine.attention import CAUSAL, FRESH, FULL, TREE, plan, plan_ragged
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.llama import Llama, apply_rope, linear
from ddserve.engine.static import (
    GraphCache,
    KVPool,
    Staging,
    fit_slots,
    fuse_weights,
    kv_step,
    layer_step,
    next_bucket,
)

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
        (StaticDFlash): they replace the packed ones, device to device, with no sync (the
        packed inputs then stop before the tree mask: pack_target without one)."""
        key = (rows_are_slots, b, w, ctx)
        if not rows_are_slots and self.prefill_eager(key):
            return self._prefill_eager(packed, key)
        inp = self.inputs.get(key)
        if inp is None:
            n = b * w
            size = 3 * n + 2 * b + (n * w if rows_are_slots else 0)  # pack_target's layout
            inp = self.inputs[key] = torch.zeros(size, dtype=torch.long, device=self.model.device)
        self.staging.copy(inp, packed)
        if trees is not None:
            n = b * w
            tok, pos, mask = trees
            inp[:n].copy_(tok.view(-1))
            inp[n : 2 * n].copy_(pos.view(-1))
            inp[3 * n + 2 * b :].copy_(mask.view(-1))
        return self.graphs.run(key, lambda: self._forward(inp, key), lane=int(not rows_are_slots))

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


class StaticDFlash:
    """A DFlash drafter over its own KV pool (its context keys/values, one slot per request,
    slots shared with the target's). One call: write the keys/values of the newly committed
    tokens' features, then run the block [root, MASK x D] of every row; returns the top
    log-probs and token ids per depth [2, B, D, K] (float64), key (B, D, ctx, K); or, with key
    (B, D, ctx, K, budget, W), each row's tree built on the GPU from its top K per depth
    (ddserve.engine.tree_triton.build_trees: tokens, positions, parents, weights, mask)."""

    def __init__(
        self,
        drafter,
        slots: int,
        max_len: int,
        guard: int,
        graphs: bool,
        layer_fn=layer_step,
        attention: str = "sdpa",
        compiled: bool = False,
    ):
        self.d = drafter
        self.layer = layer_fn
        self.attention = attention
        # the glue around its layers in a few kernels where the engine compiles: the context
        # entries' keys/values, the block's inputs, the head's top k (glue_compiled)
        self.context_entries = glue_compiled(self._context_entries, compiled)
        self.block_inputs = glue_compiled(self._block_inputs, compiled)
        self.top_k = glue_compiled(self._top_k, compiled)
        net = drafter.net
        for layer in net.layers:
            fuse_weights(layer)
        self.c = c = net.c
        self.block = c.block_size
        # feature rows a slot buffers: one round's root + accepted path at most, or the
        # roots of budget-0 rounds, which defer the context write until the rows are full
        self.new_rows = c.block_size + 1
        self.pool = KVPool(
            c, c.num_layers, slots, max_len, guard, drafter.target.device, drafter.target.dtype
        )
        self.graphs = GraphCache(graphs, "dflash")
        self.inputs: dict[tuple, torch.Tensor] = {}
        self.staging = Staging()
        # tapped target outputs of each slot's newly committed tokens, copied here right
        # after the verify that produced them; the next draft writes their keys/values
        t = drafter.target
        width = len(c.target_layers) * c.hidden_size
        self.feats = torch.zeros(slots, self.new_rows, width, device=t.device, dtype=t.dtype)
        self.vocab = None if drafter.vocab is None else drafter.vocab.to(drafter.target.device)

    @torch.inference_mode()
    def write_only(self, cwpos: np.ndarray) -> None:
        """Write the buffered context entries without a draft (budget-0 rounds, once a
        slot's feature rows are full)."""
        b = cwpos.shape[0]
        key = ("ctx", b)
        inp = self._inputs(key)
        self.staging.copy(inp, cwpos.ravel())

        def fn():  # every tensor the graph reads is made inside it or lives on (no temporaries)
            rows = torch.arange(b, device=inp.device)
            self._write_context(self.feats[:b].flatten(0, 1), rows, inp.view(b, -1))

        self.graphs.run(key, fn)

    def _inputs(self, key: tuple) -> torch.Tensor:
        """Integer inputs of a draft key (B, D, ctx, K) or of a context-only key ("ctx", B)."""
        if key not in self.inputs:
            if key[0] == "ctx":  # the context write positions alone
                n = key[1] * self.new_rows
            else:
                b, depth = key[:2]
                n = b * self.new_rows + b + 2 * b * (depth + 1) + 2 * b
            self.inputs[key] = torch.zeros(n, dtype=torch.long, device=self.feats.device)
        return self.inputs[key]

    @torch.inference_mode()
    def extend(self, slot: int, start: int, taps: torch.Tensor) -> None:
        """Eagerly write the context keys/values of many committed tokens (a prompt's) at
        positions start.. of one slot: contiguous, so each layer's keys and values go in by
        one slice copy (no index tensors: on the H200 the indexed writes and the index's
        host-to-device copy made a newcomer's catch-up ~0.9 ms of host time, bench/NOTES.md)."""
        n = taps.shape[0]
        wpos = torch.arange(start, start + n, device=taps.device)
        for i, (k, v) in enumerate(self._context_kv(taps.to(self.d.target.dtype), wpos)):
            self.pool.k[i][slot, :, start : start + n] = k.transpose(0, 1)
            self.pool.v[i][slot, :, start : start + n] = v.transpose(0, 1)

    def _context_kv(self, taps, wpos):
        """Per drafter layer, the context keys (RoPE applied) and values [N, kvh, hd] of the
        tapped features `taps` [N, taps*H] at positions `wpos` (N of them, any shape)."""
        net, c = self.d.net, self.c
        feats = net.project(taps)  # [N, H]
        cos, sin = net.rotary(wpos.reshape(-1), feats.dtype)
        for layer in net.layers:
            kv = linear(feats, layer.qkv_weight[c.num_heads * c.head_dim :])
            k, v = kv.view(-1, 2 * c.num_kv_heads, c.head_dim).chunk(2, dim=1)
            yield apply_rope(k, cos[:, None], sin[:, None]), v

    def _write_context(self, taps, rows, wpos) -> None:
        """The context keys/values of `taps` [B*Wn, ...] at positions `wpos` [B, Wn] of the
        slots `rows` [B] (a draft graph's write: any positions, padding to guard entries):
        every layer's keys and values in one indexed write."""
        self.pool.kv[:, :, rows[:, None], :, wpos] = self.context_entries(taps, wpos)

    def _context_entries(self, taps, wpos) -> torch.Tensor:
        """The keys and values of every layer for `taps` at `wpos` [B, Wn], as the pool's
        indexed write takes them: [B, Wn, 2, layers, kvh, hd]."""
        b, wn = wpos.shape
        per_layer = [torch.stack(kv) for kv in self._context_kv(taps, wpos)]  # [2, N, kvh, hd]
        kv = torch.stack(per_layer, dim=1)  # [2, layers, N, kvh, hd]
        return kv.permute(2, 0, 1, 3, 4).reshape(b, wn, *kv.shape[:2], *kv.shape[3:])

    def _block_inputs(self, root, bpos, depth: int):
        """The block [root, MASK x depth] of every row embedded, [B*(depth+1), H], and its
        RoPE cos/sin at positions `bpos`."""
        net, t = self.d.net, self.d.target
        emb = t.embed_tokens(root)[:, None]  # [B, 1, H]
        x = torch.cat([emb, net.mask_embedding.to(emb.dtype).expand(root.shape[0], depth, -1)], 1)
        x = x.reshape(root.shape[0] * (depth + 1), -1)
        cos, sin = net.rotary(bpos, x.dtype)
        return x, cos, sin

    def _top_k(self, x, b: int, depth: int, topk: int):
        """The last layer's outputs x [B*(depth+1), H] -> the top `topk` log-probs and token
        ids at each MASK position, [B*depth, topk] each (float32; ids in the target's
        vocabulary)."""
        hidden = self.d.net.norm(x).view(b, depth + 1, -1)[:, 1:].reshape(b * depth, -1)
        logp = torch.log_softmax(linear(hidden, self.d.head).float(), dim=-1)
        vals, idx = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
        return vals, (idx if self.vocab is None else self.vocab[idx])

    @torch.inference_mode()
    def forward(self, packed: np.ndarray, key: tuple):
        inp = self._inputs(key)
        self.staging.copy(inp, packed)
        return self.graphs.run(key, lambda: self._forward(key))

    def _forward(self, key: tuple):
        b, depth, ctx, topk = key[:4]
        inp = self._inputs(key)
        net, c = self.d.net, self.c
        wn, q = self.new_rows, depth + 1
        at = 0

        def take(size):
            nonlocal at
            at += size
            return inp[at - size : at]

        cwpos = take(b * wn).view(b, wn)
        root = take(b)
        bwpos = take(b * q).view(b, q)
        bpos = take(b * q)
        lens, window = take(b), take(b)
        rows = torch.arange(b, device=inp.device)
        self._write_context(self.feats[:b].flatten(0, 1), rows, cwpos)
        x, cos, sin = self.block_inputs(root, bpos, depth)
        groups = c.num_heads // c.num_kv_heads
        attn = plan(self.attention, lens, FULL, None, q, ctx, groups, x.dtype, window)
        for i, layer in enumerate(net.layers):
            x = self.layer(
                layer, x, cos, sin, self.pool.k[i], self.pool.v[i], rows, bwpos, attn, True
            )
        vals, ids = self.top_k(x, b, depth, topk)
        if len(key) == 4:  # the top-k to the host, which builds the trees
            return torch.stack([vals.double(), ids.double()]).view(2, b, depth, -1)
        from ddserve.engine.tree_triton import build_trees  # where triton is

        budget, width = key[4:]  # the trees here, as the verify's inputs
        lp, ids = vals.double().view(b, depth, -1), ids.view(b, depth, -1)
        return build_trees(lp, ids, root, lens, budget, lp.shape[-1], width)


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


def pack_draft(cwpos, root, bwpos, bpos, lens, window) -> np.ndarray:
    return np.concatenate([cwpos.ravel(), root, bwpos.ravel(), bpos.ravel(), lens, window])


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
