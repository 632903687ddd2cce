"""A Llama-architecture decoder with an explicit KV cache and tree attention masks.

Written for speculation rather than taken from transformers: one forward takes any set of
new tokens with their own positions and a boolean mask over [cache + new tokens], writes
their keys/values into the cache as *pending* entries, and the caller commits the ones it
keeps (`KVCache.commit`). Weights load from a Hugging Face Llama state dict, so outputs
match `transformers` (tests/engine/test_llama.py checks it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    # RoPE frequency scaling, as transformers' `rope_parameters` less rope_theta: None, or
    # {"rope_type": "linear" | "llama3", ...its parameters} (ROPE_TYPES)
    rope_scaling: dict | None = field(default=None, hash=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T. On CPU, (w @ x.T).T is faster for the few-row products of decoding, and a
    single row times a big matrix goes through it as two rows (the matrix-vector kernel reads
    the weights at a third of the speed). SmolLM2's LM head, 576->49152, on this 2-core AMD
    CPU: 1 row 9.8 ms as a matrix-vector product vs 2.9 ms as two rows; 5 rows 5.9 ms vs
    18.7 ms with F.linear. Small matrices stay matrix-vector (0.07 vs 0.12 ms)."""
    # x: [N, in]  w: [out, in]
    if x.device.type == "cpu" and x.shape[0] <= 64:
        if x.shape[0] == 1 and w.numel() >= 1 << 23:  # big matrices only (the LM head)
            return (w @ x.repeat(2, 1).T).T[:1]
        return (w @ x.T).T
    return F.linear(x, w)


def project(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    """x @ W.T (+ b): a projection that may carry a bias (Qwen2's q/k/v)."""
    y = linear(x, proj.weight)
    return y if proj.bias is None else y + proj.bias


class KVCache(nn.Module):
    """Keys/values of one sequence: [layers, kv_heads, capacity, head_dim], grown by doubling.

    Entries [0, length) are committed. A forward writes its new tokens at [length, length+N)
    as pending entries; `commit(keep)` moves the kept ones to [length, length+len(keep)).
    `start_pos` is the absolute position of entry 0 (a sliding window evicts from the front).
    """

    def __init__(
        self, cfg: LlamaConfig, num_layers: int, capacity: int = 256, *, device=None, dtype=None
    ):
        super().__init__()
        shape = (num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.length = 0
        self.start_pos = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @torch.inference_mode()
    def reserve(self, n_new: int) -> None:
        need = self.length + n_new
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store pending k/v [kv_heads, N, hd]; return all keys/values [kv_heads, length+N, hd]."""
        n = k.shape[1]
        end = self.length + n
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor | list[int] | int) -> None:
        """Keep pending entries `keep` (indices into the last forward's tokens, ascending)."""
        if isinstance(keep, int):
            self.length += keep
            return
        idx = torch.as_tensor(keep, dtype=torch.long, device=self.k.device)
        src = idx + self.length
        n = idx.numel()
        if not torch.equal(idx, torch.arange(n, device=idx.device)):
            self.k[:, :, self.length : self.length + n] = self.k[:, :, src]
            self.v[:, :, self.length : self.length + n] = self.v[:, :, src]
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def evict_front(self, n: int) -> None:
        """Drop the n oldest entries (sliding window); positions of the rest are unchanged."""
        if n <= 0:
            return
        n = min(n, self.length)
        rest = self.length - n
        self.k[:, :, :rest] = self.k[:, :, n : self.length].clone()
        self.v[:, :, :rest] = self.v[:, :, n : self.length].clone()
        self.length = rest
        self.start_pos += n

    @property
    def next_pos(self) -> int:
        return self.start_pos + self.length


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        h, hd = cfg.hidden_size, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_eps)

    def forward(self, x, cos, sin, caches: list[KVCache], layer: int, masks, sizes: list[int]):
        """x: [N, H] = the new tokens of len(caches) sequences packed back to back (`sizes`
        rows each); cos/sin: [N, hd]; masks[i]: [n_i, length_i + n_i] bool (True = attend).
        Projections and MLP run once over all rows (the weights are read once per step);
        attention runs per sequence over its own cache."""
        cfg = self.cfg
        n = x.shape[0]
        h = self.input_layernorm(x)
        q = project(h, self.q_proj).view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = project(h, self.k_proj).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = project(h, self.v_proj).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if len(caches) == 1:
            parts = [(q, k, v)]
        else:
            parts = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), strict=True)
        outs = []
        for (qi, ki, vi), cache, mask in zip(parts, caches, masks, strict=True):
            keys, values = cache.write(layer, ki, vi)
            # qi: [heads, n_i, hd]  keys/values: [kv_heads, T_i, hd]  mask: [n_i, T_i]
            outs.append(
                F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, enable_gqa=True)
            )
        att = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        att = att.transpose(0, 1).reshape(n, cfg.num_heads * cfg.head_dim)
        x = x + linear(att, self.o_proj.weight)
        h = self.post_attention_layernorm(x)
        mlp = F.silu(linear(h, self.gate_proj.weight)) * linear(h, self.up_proj.weight)
        return x + linear(mlp, self.down_proj.weight)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


ROPE_TYPES = ("default", "linear", "llama3")  # what `rope_inv_freq` computes


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2], float32, as transformers computes them.

    linear: every frequency divided by `factor`. llama3 (Llama 3.1+): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../ high_freq_factor kept, and the band between interpolated smoothly between the two.
    Neither changes the attention scale (their attention factor is 1)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope_type={kind!r} is not implemented; known: {', '.join(ROPE_TYPES)}")
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """RoPE angles for positions of any shape [...] -> cos/sin [..., head_dim]. The inverse
    frequencies stay float32 when the model goes to bf16 (rounding them would shift every
    angle by up to ~0.4%)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", self.compute(), persistent=False)

    def compute(self) -> torch.Tensor:
        return rope_inv_freq(self.head_dim, self.theta, self.scaling)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self.compute().to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def rope_inv_freq(self) -> torch.Tensor:
        return self.rotary.compute()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacity: int = 256, num_layers: int | None = None) -> KVCache:
        return KVCache(
            self.cfg,
            num_layers or self.cfg.num_layers,
            capacity,
            device=self.device,
            dtype=self.dtype,
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        *,
        num_layers: int | None = None,
        last_only: bool = False,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, V] (or [1, V] with last_only) for new `tokens` [N] at `positions` [N].

        mask: [N, N] bool among the new tokens (True = attend), default causal; every new
        token also sees all committed cache entries. Writes pending cache entries; the
        caller decides what to keep with `cache.commit`. With `capture` (layer indices), also
        returns the outputs of those layers for every new token, concatenated: [N, len*H]
        (what a DFlash drafter is conditioned on; no extra target pass).
        """
        out = self.forward_batch(
            [tokens],
            [positions],
            [cache],
            [mask],
            num_layers=num_layers,
            capture=capture,
            last_only=last_only,
        )
        return out[0][0] if not capture else (out[0][0], out[1][0])

    @torch.inference_mode()
    def forward_batch(
        self,
        tokens: list[torch.Tensor],
        positions: list[torch.Tensor],
        caches: list[KVCache],
        masks: list[torch.Tensor | None],
        *,
        num_layers: int | None = None,
        capture: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """`forward` for several sequences in one pass (their new tokens packed, each with
        its own cache and mask): (logits per sequence, captured layer outputs per sequence)."""
        sizes = [t.shape[0] for t in tokens]
        fulls = []
        for n, cache, mask in zip(sizes, caches, masks, strict=True):
            cache.reserve(n)
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
            full = torch.ones(n, cache.length + n, dtype=torch.bool, device=self.device)
            full[:, cache.length :] = mask
            fulls.append(full)
        one = len(tokens) == 1
        cos, sin = self.rope(positions[0] if one else torch.cat(positions))
        x = self.embed_tokens(tokens[0] if one else torch.cat(tokens))
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        taps = []
        for i, block in enumerate(layers):
            x = block(x, cos, sin, caches, i, fulls, sizes)
            if i in capture:
                taps.append(x)
        if last_only:  # the last row of every sequence
            ends = torch.tensor(sizes, device=x.device).cumsum(0) - 1
            x = x[ends]
            sizes = [1] * len(sizes)
        logits = linear(self.norm(x), self.lm_head.weight).float()
        per_seq = [logits] if one else list(logits.split(sizes))
        if not capture:
            return per_seq, None
        hidden = torch.cat(taps, dim=-1)
        return per_seq, [hidden] if one else list(hidden.split([t.shape[0] for t in tokens]))
