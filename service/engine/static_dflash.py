"""The DFlash drafter as a fixed-shape forward over its own KV pool (ddserve.engine.static),
the static engine's draft step runs it (ddserve.engine.static_draft): one call writes the
newly committed tokens' context entries and drafts every row's block; its integer inputs
come packed in one host tensor (`pack_draft`), like the target's (ddserve.engine.static_models).
"""

from __future__ import annotations

import numpy as np
import torch

from ddserve.engine.attention import FULL, plan
from ddserve.engine.graphs import GraphCache
from ddserve.engine.llama import apply_rope, linear
from ddserve.engine.static import KVPool, Staging, fuse_weights, layer_step, next_bucket
from ddserve.engine.static_models import glue_compiled
from ddserve.errors import EngineError

# prompts' context rows written by one catch-up: as a CUDA graph per power of two from
# CATCH_UP_MIN_ROWS up to CATCH_UP_GRAPH_ROWS (captured at warm-up), eagerly past it, one
# `extend` a prompt (0: always so, as before 2026-12-07: benchmarks' switch, bench.tuned's
# engine knobs)
CATCH_UP_MIN_ROWS, CATCH_UP_GRAPH_ROWS = 16, 4096
# feature rows a slot buffers (at least a draft's `new_rows`): budget-0 rounds put a row a
# step there and write them as the drafter's context only when they are full (or before the
# next draft). At 9 rows (one block + 1, the buffer a draft needs) a 4-step trip wrote every
# second trip (~40 launches over every slot's rows, host and GPU idle between trips), part
# of what kept the DFlash engine's budget-0 rounds at ~0.94x the drafter-free engine on the
# H100 (bench/NOTES.md). 0: a draft's rows (as before 2026-12-07; bench.tuned's switch)
BUFFERED_ROWS = 32


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
        # feature rows a draft writes as context: one round's root + accepted path at most
        self.new_rows = c.block_size + 1
        # rows a slot buffers: also budget-0 rounds' roots, written when full (BUFFERED_ROWS)
        self.rows = max(self.new_rows, BUFFERED_ROWS)
        if self.rows > guard:  # a write's unused rows go to guard entries: never past them
            raise EngineError(f"{self.rows} buffered DFlash feature rows; the guard has {guard}")
        self.pool = KVPool(
            c, c.num_layers, slots, max_len, guard, drafter.target.device, drafter.target.dtype
        )
        self.graphs = GraphCache(graphs, "dflash")
        self.inputs: dict[tuple, torch.Tensor] = {}
        self.catch_up_feats: torch.Tensor | None = None  # the catch-up's feature rows
        self.last_key = None  # the last draft's shape (`again`)
        self.staging = Staging()
        # tapped target outputs of each slot's newly committed tokens, copied here right
        # after the verify that produced them; the next draft writes their keys/values
        t = drafter.target
        width = len(c.target_layers) * c.hidden_size
        self.feats = torch.zeros(slots, self.rows, width, device=t.device, dtype=t.dtype)
        self.vocab = None if drafter.vocab is None else drafter.vocab.to(drafter.target.device)

    @torch.inference_mode()
    def write_only(self, cwpos: np.ndarray) -> None:
        """Write the buffered context entries without a draft (budget-0 rounds, once a
        slot's feature rows are full, or before a draft its rows would not fit): `cwpos`
        [B, rows]."""
        b = cwpos.shape[0]
        key = ("ctx", b)
        inp = self._inputs(key)
        self.staging.copy(inp, cwpos.ravel())

        def fn():  # every tensor the graph reads is made inside it or lives on (no temporaries)
            rows = torch.arange(b, device=inp.device)
            self._write_context(self.feats[:b].flatten(0, 1), rows, inp.view(b, -1))

        self.graphs.run(key, fn)

    def _inputs(self, key: tuple) -> torch.Tensor:
        """Integer inputs of a draft key (B, D, ctx, K), of a context-only key ("ctx", B) or
        of a catch-up ("catch_up", rows)."""
        if key not in self.inputs:
            if key[0] == "ctx":  # the context write positions alone
                n = key[1] * self.rows
            elif key[0] == "catch_up":  # each row's slot and position
                n = 2 * key[1]
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

    @torch.inference_mode()
    def extend_many(self, slots: list[int], starts: list[int], taps: list[torch.Tensor]) -> None:
        """`extend` for several slots at once (the prompts that went in since the last draft):
        one projection over all their rows and one indexed write of every layer's keys and
        values, padded to a power of two of rows (the padding writes a guard entry), one
        CUDA graph per size (captured at warm-up). Eager, ~40 launches a call, it was ~10%
        of the worker's time at 64 requests on an H100 (a newcomer or two a round,
        bench/NOTES.md). Past CATCH_UP_GRAPH_ROWS rows one `extend` each (long prompts:
        their prefill dwarfs the launches)."""
        lens = [t.shape[0] for t in taps]
        n = sum(lens)
        if not n:
            return
        if n > CATCH_UP_GRAPH_ROWS:
            for slot, start, t in zip(slots, starts, taps, strict=True):
                self.extend(slot, start, t)
            return
        nb = next_bucket(n, CATCH_UP_MIN_ROWS, CATCH_UP_GRAPH_ROWS)
        rows = np.full(nb, slots[0], dtype=np.int64)
        pos = np.full(nb, self.pool.max_len - 1, dtype=np.int64)  # the padding's: a guard entry
        rows[:n] = np.repeat(slots, lens)
        pos[:n] = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, lens, strict=True)])
        self._write_rows(rows, pos, taps)

    def _write_rows(self, rows: np.ndarray, pos: np.ndarray, taps: list[torch.Tensor]) -> None:
        """Write the context entries of `taps` (their rows in order, then padding) at slots
        `rows` and positions `pos`, as the graph of that many rows."""
        nb = rows.size
        key = ("catch_up", nb)
        inp = self._inputs(key)
        self.staging.copy(inp, np.concatenate([rows, pos]))
        if self.catch_up_feats is None:  # zeros at first: the padding rows stay finite
            shape = (CATCH_UP_GRAPH_ROWS, self.feats.shape[-1])
            dev, dtype = self.feats.device, self.feats.dtype
            self.catch_up_feats = torch.zeros(shape, device=dev, dtype=dtype)
        feats = self.catch_up_feats[:nb]  # every size's rows at one address
        if taps:
            n = sum(t.shape[0] for t in taps)
            torch.cat([t.to(feats.dtype) for t in taps], out=feats[:n])

        def fn():  # reads only buffers that live on (the graph's inputs)
            slot, wpos = inp.view(2, nb)
            entries = self._context_entries(feats, wpos[None])[0]  # [N, 2, layers, kvh, hd]
            self.pool.kv[:, :, slot, :, wpos] = entries

        self.graphs.run(key, fn)

    def warm_up_catch_up(self) -> None:
        """Capture the catch-up's graph of every size, writing only a guard entry of slot 0."""
        nb = CATCH_UP_MIN_ROWS
        while nb <= CATCH_UP_GRAPH_ROWS:
            self._write_rows(np.zeros(nb, np.int64), np.full(nb, self.pool.max_len - 1), [])
            nb *= 2

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

    def guard_inputs(self, b: int, depth: int) -> np.ndarray:
        """A draft's packed inputs for `b` rows that hold no request: every write to the
        guard entries (the warm-up's captures)."""
        ml, wn, q = self.pool.max_len, self.new_rows, depth + 1
        return pack_draft(
            np.tile(np.arange(ml - wn, ml), (b, 1)),
            np.zeros(b, np.int64),
            np.tile(np.arange(ml - q, ml), (b, 1)),
            np.zeros((b, q), np.int64),
            np.zeros(b, np.int64),
            np.full(b, ml, np.int64),
        )

    @torch.inference_mode()
    def forward(self, packed: np.ndarray, key: tuple):
        inp = self._inputs(key)
        self.staging.copy(inp, packed)
        self.last_key = key
        return self.graphs.run(key, lambda: self._forward(key))

    def again(self):
        """The last forward's shape once more, from its inputs as they are on the device now
        (ddserve.engine.static_spec rewrites them there between rounds)."""
        key = self.last_key
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
        self._write_context(self.feats[:b, :wn].reshape(b * wn, -1), rows, cwpos)
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


def pack_draft(cwpos, root, bwpos, bpos, lens, window) -> np.ndarray:
    return np.concatenate([cwpos.ravel(), root, bwpos.ravel(), bpos.ravel(), lens, window])
