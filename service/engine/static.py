"""Static GPU state for the DDTree engine: a preallocated KV pool and fixed-shape forwards
that CUDA graphs can capture.

    KVPool       keys/values of every slot: [layers, slots, kv_heads, max_len, head_dim],
                 allocated once; a request holds one slot for its lifetime. The last `guard`
                 entries of every slot are scratch: rows that take part in a forward only to
                 fill a fixed shape write there.
    SlotCache    one slot seen through the KVCache interface (length, write, commit), so the
                 eager code paths (prefill of odd lengths, tests) work on the pool unchanged.
    layer_step   one decoder layer over B rows x W new tokens with index writes into the pool
                 and attention over each row's slot (ddserve.engine.attention: the sdpa
                 reference over [0, ctx), or the triton kernel over each row's own length);
                 shapes depend only on (B, W, ctx), so a captured graph replays it for any
                 content (with triton, ctx is one of two context classes, 512 or the pool's
                 length, that only bound the key splits: one graph per (B, W) and class
                 serves every length within it).
(GraphCache, which captures one CUDA graph per shape key and replays it: ddserve.engine.graphs)

Rows of a forward are either slots 0..B-1 themselves (decode: every active request is a row,
and keys are read in place) or slots named by an index tensor (prefill of one request: its
slot's keys are gathered).
"""

from __future__ import annotations

import logging
import math
import mmap

import numpy as np
import torch
import torch.nn.functional as F

from ddserve.engine.attention import Attn, attend
from ddserve.engine.attention import backend as attention_backend
from ddserve.engine.llama import Block, LlamaConfig, apply_rope, linear
from ddserve.errors import ConfigError, EngineError

log = logging.getLogger(__name__)


def next_bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n (at least lo), capped at hi."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def zeros(shape: tuple[int, ...], device, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros; on CPU an anonymous mapping, whose pages take memory only once written,
    so a pool sized for max_batch x max_context costs what the requests actually use. Its
    pages stay small (MADV_NOHUGEPAGE): a slot's keys of one head and layer are 2 MB at 8,192
    entries, so where transparent huge pages are on (numpy asks for them on large arrays) a
    request's first entry committed all 2 MB, its slot's whole context: 32 short requests
    took the CPU engine from 1.9 to 13.9 GB (bench/NOTES.md)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    n = math.prod(shape) * dtype.itemsize
    # private (as calloc's: a forked process's writes stay its own), anonymous: zero pages
    # until written
    buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):  # no such advice here (no huge pages to refuse)
        pass
    raw = np.frombuffer(buf, dtype=np.uint8, count=n)  # keeps the mapping alive
    return torch.from_numpy(raw).view(dtype).view(shape)


class Staging:
    """Host-to-device copies of packed integer inputs that do not wait for the GPU: on CUDA
    through a pinned buffer per input, so the host packs the next forward while the GPU still
    runs the last one. A buffer is rewritten only after the copy out of it has run (an event
    per buffer: free once the round's sync has passed, a wait where forwards follow each other
    with no sync, as prefill chunks do). `packed` may be shorter than `dst` (its first part).
    Elsewhere a plain copy."""

    def __init__(self):
        self.buffers: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def copy(self, dst: torch.Tensor, packed: np.ndarray) -> None:
        n = packed.size
        if dst.device.type != "cuda":
            dst[:n].copy_(torch.from_numpy(packed.ravel()))
            return
        entry = self.buffers.get(id(dst))
        if entry is None:
            buf = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
            entry = self.buffers[id(dst)] = (buf, torch.cuda.Event())
        buf, done = entry
        done.synchronize()  # the last copy out of this buffer has run (no-op if never recorded)
        np.copyto(buf[:n].numpy(), packed.ravel(), casting="same_kind")
        dst[:n].copy_(buf[:n], non_blocking=True)
        done.record()


class KVPool:
    def __init__(
        self, cfg: LlamaConfig, num_layers: int, slots: int, max_len: int, guard: int, device, dtype
    ):
        self.slots, self.max_len, self.guard = slots, max_len, guard
        self.usable = max_len - guard  # entries a request may fill
        self.kv_heads = cfg.num_kv_heads
        shape = (num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        # keys and values in one buffer (k = kv[0], v = kv[1]): a round's moves are one
        # gather and one scatter over both (`move_entries`)
        self.kv = zeros((2, *shape), device, dtype)
        self.k, self.v = self.kv[0], self.kv[1]
        self._free = list(range(slots))

    @staticmethod
    def slot_bytes(cfg: LlamaConfig, num_layers: int, max_len: int, dtype: torch.dtype) -> int:
        """Bytes one slot of such a pool takes (keys and values)."""
        return 2 * num_layers * cfg.num_kv_heads * max_len * cfg.head_dim * dtype.itemsize

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise EngineError(f"all {self.slots} KV slots are in use")
        low = min(self._free)  # lowest first: decode batches cover slots 0..used_rows-1
        self._free.remove(low)
        return low

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    @property
    def used_rows(self) -> int:
        """1 + the highest slot in use (decode batches cover slots 0..used_rows-1)."""
        taken = set(range(self.slots)) - set(self._free)
        return max(taken) + 1 if taken else 0

    def guard_positions(self, w: int) -> torch.Tensor:
        return torch.arange(self.max_len - w, self.max_len)

    def entries(self, slots: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Where entries `pos` of `slots` lie in the pool seen as [2 x layers, slot x head x
        position, head_dim] (`move_entries`): one index per (entry, KV head), int64."""
        kvh = self.kv_heads
        heads = (np.asarray(slots, np.int64)[:, None] * kvh + np.arange(kvh)) * self.max_len
        return (heads + np.asarray(pos, np.int64)[:, None]).reshape(-1)

    @torch.inference_mode()
    def move(self, slots, dst, src) -> None:
        """Copy entries src -> dst within their slots, all layers at once (the accepted path
        of a tree moves next to the committed prefix). dst <= src, gathered before written.
        Lists or arrays of ints."""
        if not len(slots):
            return
        idx = np.concatenate([self.entries(slots, dst), self.entries(slots, src)])
        idx = torch.from_numpy(idx).to(self.kv.device)
        half = idx.shape[0] // 2
        self.move_entries(idx[:half], idx[half:])

    @torch.inference_mode()
    def move_entries(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`move` by `entries`' indices (int64 on the pool's device): keys and values of
        every layer in one gather and one scatter (where keys and values took an
        advanced-index gather and write each: four launches, each with its index setup)."""
        rows = self.kv.view(self.kv.shape[0] * self.kv.shape[1], -1, self.kv.shape[-1])
        rows.index_copy_(1, dst, rows.index_select(1, src))


def fit_slots(wanted: int, per_slot: int, free: int, total: int, fraction: float) -> int:
    """How many KV slots of `per_slot` bytes the pool gets: at most `wanted`, within what is
    free now less the (1 - fraction) of the device's `total` kept for activations, graphs and
    everything else (vLLM's --gpu-memory-utilization). Not even one: a ConfigError that says
    what to change."""
    budget = free - (1.0 - fraction) * total
    n = int(budget // per_slot) if budget > 0 else 0
    if n < 1:
        gib = 1 << 30
        raise ConfigError(
            f"the KV cache of one request at this max_context needs {per_slot / gib:.2f} GiB; "
            f"{max(budget, 0) / gib:.2f} GiB are left for it at gpu_memory_utilization="
            f"{fraction:g} ({free / gib:.1f} of {total / gib:.1f} GiB free after the weights): "
            "lower --max-context or raise --gpu-memory-utilization"
        )
    return min(wanted, n)


class SlotCache:
    """One slot of a KVPool with KVCache's interface (positions start at 0; no eviction)."""

    def __init__(self, pool: KVPool, slot: int):
        self.pool, self.slot = pool, slot
        self.length = 0
        self.start_pos = 0

    @property
    def capacity(self) -> int:
        return self.pool.usable

    @property
    def next_pos(self) -> int:
        return self.length

    def reserve(self, n_new: int) -> None:
        """Pending entries may run into the guard (a tree verified at the end of the context);
        committed ones stay within `usable` because requests are admitted within max_context."""
        if self.length + n_new > self.pool.max_len:
            raise EngineError(
                f"context of {self.length + n_new} tokens exceeds the KV slot's {self.pool.max_len}"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[1]
        self.pool.k[layer, self.slot, :, self.length : end] = k
        self.pool.v[layer, self.slot, :, self.length : end] = v
        return self.pool.k[layer, self.slot, :, :end], self.pool.v[layer, self.slot, :, :end]

    def commit(self, keep) -> None:
        if isinstance(keep, int):
            self.length += keep
            return
        keep = list(keep)
        moves = [(self.length + j, self.length + i) for j, i in enumerate(keep) if i != j]
        if moves:
            d, s = zip(*moves, strict=True)
            self.pool.move([self.slot] * len(d), list(d), list(s))
        self.length += len(keep)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def fuse_weights(block: Block) -> None:
    """One [q;k;v] and one [gate;up] matrix per layer (one matmul each instead of three and
    two), and one [q;k;v] bias where the projections have biases (Qwen2; else None); the
    original projections become views of them, so state dicts are unchanged."""
    if hasattr(block, "qkv_weight"):
        return
    parts = [block.q_proj, block.k_proj, block.v_proj]
    with torch.no_grad():
        qkv = _fuse([p.weight for p in parts])
        bias = _fuse([p.bias for p in parts]) if parts[0].bias is not None else None
        gu = _fuse([block.gate_proj.weight, block.up_proj.weight])
    block.qkv_weight, block.qkv_bias, block.gate_up_weight = qkv, bias, gu


def _fuse(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 and make each tensor a view of its part of the result."""
    fused = torch.cat(tensors)
    at = 0
    for t in tensors:
        n = t.shape[0]
        t.data = fused[at : at + n]
        at += n
    return fused


def layer_step(block: Block, x, cos, sin, kc, vc, rows, wpos, attn: Attn, rows_are_slots):
    """One decoder layer. x [B*W, H]; cos/sin [B*W, hd]; kc/vc: this layer's pool
    [S, kvh, L, hd]; rows [B] slot of each row; wpos [B, W] where each new token's key/value
    goes; attn: the forward's attention inputs (ddserve.engine.attention.plan)."""
    c = block.cfg
    nh, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
    b, w = wpos.shape
    n = b * w
    h = block.input_layernorm(x)
    qkv = linear(h, block.qkv_weight)
    if block.qkv_bias is not None:
        qkv = qkv + block.qkv_bias
    qkv = qkv.view(n, nh + 2 * kvh, hd)
    qk = apply_rope(qkv[:, : nh + kvh], cos[:, None], sin[:, None])
    q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + kvh :]
    kc[rows[:, None], :, wpos] = k.reshape(b, w, kvh, hd)
    vc[rows[:, None], :, wpos] = v.reshape(b, w, kvh, hd)
    att = attend(q, kc, vc, rows, b, w, attn, rows_are_slots, k, v)
    x = x + linear(att, block.o_proj.weight)
    h = block.post_attention_layernorm(x)
    gate, up = linear(h, block.gate_up_weight).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, block.down_proj.weight)


def kv_step(block: Block, x, cos, sin, kc, vc, rows, wpos) -> None:
    """What a prompt chunk needs of the target's last layer when nothing taps it: its keys and
    values, written as `layer_step` writes them (the chunk has no logits, and no later layer
    reads its output). The rest of the layer (queries, attention, the MLP) is 1/L of the
    prefill forward that nothing reads."""
    c = block.cfg
    q_rows, kvh, hd = c.num_heads * c.head_dim, c.num_kv_heads, c.head_dim
    b, w = wpos.shape
    h = block.input_layernorm(x)
    kv = linear(h, block.qkv_weight[q_rows:])
    if block.qkv_bias is not None:
        kv = kv + block.qkv_bias[q_rows:]
    kv = kv.view(b * w, 2 * kvh, hd)
    k = apply_rope(kv[:, :kvh], cos[:, None], sin[:, None])
    kc[rows[:, None], :, wpos] = k.reshape(b, w, kvh, hd)
    vc[rows[:, None], :, wpos] = kv[:, kvh:].reshape(b, w, kvh, hd)


def compile_layer_step():
    """layer_step through torch.compile (inductor fuses the norms, RoPE, SiLU*up and the
    residual adds into a few kernels per layer). dynamic=True: one compilation serves every
    batch, width and context size; weights are inputs, so all layers (and the drafter's)
    share it. The engine makes one and hands it to its forwards."""
    import torch._dynamo

    # every (B, W, ctx) class that dynamic shapes specialise on counts against this limit
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    return torch.compile(layer_step, dynamic=True)


def fused_layers_on(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused layer kernels (ddserve.engine.layer_triton) run: auto = with CUDA in
    bf16 when triton's kernels run there (as the attention backend decides; in fp32 their
    exact IEEE products ran 4x slower than cuBLAS on the H200, and in fp16 the norm's
    x * weight, rounded before the 1/rms scale, could overflow); on = wherever triton runs
    (on CPU only in its interpreter: the tests), else a config error naming the fix."""
    if choice == "off":
        return False
    if choice == "auto":
        bf16 = dtype == torch.bfloat16
        return bf16 and device.type == "cuda" and attention_backend("auto", device) == "triton"
    try:
        attention_backend("triton", device)
    except ConfigError as exc:
        raise ConfigError(
            "fused_layers=on needs triton and a CUDA device; use --fused-layers auto or off",
            param="fused_layers",
        ) from exc
    return True
