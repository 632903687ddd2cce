"""A DFlash-style block drafter: all L draft positions in one forward.

Following the public DFlash design (z-lab/dflash; written here from the description, not
copied):

  context  the outputs of a few target layers for every committed token except the root,
           concatenated, projected to the hidden size and RMS-normalised (`fc`, `hidden_norm`);
           the engine keeps them from the verify forward, so there is no extra target pass
  block    [root token, MASK x L] embedded with the target's (frozen) embeddings; MASK is a
           learned vector
  layers   a few decoder layers; their keys/values cover the projected context plus the
           block; attention inside the block is bidirectional; RoPE on absolute positions
  output   final norm + the target's (frozen, shared) LM head at the L MASK positions gives
           the per-depth distributions the DDTree is built from

Only the drafter's own weights are stored (a few MB): `save_dflash` / `load_dflash`.
`DFlashDrafter` holds the weights, the target and the draft vocabulary; the engine runs it
batched over its own KV pool (`ddserve.engine.static_dflash.StaticDFlash`), writing each
request's context keys/values once, so a round only projects the newly committed tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ddserve.engine.llama import Block, Llama, LlamaConfig, RMSNorm, Rotary, apply_rope, linear
from ddserve.engine.weights import unreadable
from ddserve.errors import ConfigError

BUILTIN_DIR = Path(__file__).parent / "dflash_weights"
BUILTIN = {"smollm2-135m": BUILTIN_DIR / "smollm2-135m"}


@dataclass(frozen=True)
class DFlashConfig:
    target_layers: tuple[int, ...]  # target layers whose outputs condition the drafter
    num_layers: int  # drafter decoder layers
    block_size: int  # L: positions predicted per forward
    # the target's shapes (the drafter shares its embeddings, LM head and RoPE)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_num_layers: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: str = ""  # a name for the target it was trained against
    qkv_bias: bool = False  # (Block reads it) the drafter's projections have no biases

    @classmethod
    def for_target(cls, t: LlamaConfig, *, num_layers=2, block_size=8, taps=4, target=""):
        n = t.num_layers
        # evenly spaced from the second layer to the third-last (DFlash's choice of taps)
        hi = max(0, n - 3)  # never the last layer (transformers reports it normalised)
        lo = min(1, hi)
        layers = sorted({round(lo + i * (hi - lo) / max(1, taps - 1)) for i in range(taps)})
        return cls(
            target_layers=tuple(layers),
            num_layers=num_layers,
            block_size=block_size,
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            target_num_layers=n,
            rope_theta=t.rope_theta,
            rms_eps=t.rms_eps,
            target=target,
        )

    def check_target(self, t: LlamaConfig) -> None:
        ours = (self.vocab_size, self.hidden_size, self.target_num_layers)
        theirs = (t.vocab_size, t.hidden_size, t.num_layers)
        if ours != theirs:
            raise ConfigError(
                f"the DFlash drafter was trained for a target with (vocab, hidden, layers)={ours}, "
                f"this target has {theirs}"
            )


class DraftLayer(Block):
    """A decoder layer (the target's layer shapes and weight names) whose keys/values span
    [context features, block] instead of a KV cache."""

    def __init__(self, c: DFlashConfig):
        super().__init__(c)  # DFlashConfig carries every shape Block reads
        self.c = c

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        # [B, T, n*hd] -> [B, n, T, hd]
        return t.unflatten(-1, (n, self.c.head_dim)).transpose(1, 2)

    def context_kv(self, ctx, cos, sin):
        """Keys/values of projected context features ctx [B, T, H] -> 2 x [B, kvh, T, hd]."""
        k = self._heads(_lin(ctx, self.k_proj.weight), self.c.num_kv_heads)
        v = self._heads(_lin(ctx, self.v_proj.weight), self.c.num_kv_heads)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        # x [B, Q, H]; cos/sin [B, 1, Q, hd]; ctx_k/v [B, kvh, T, hd]; mask [B, 1, Q, T+Q]
        c = self.c
        h = self.input_layernorm(x)
        q = apply_rope(self._heads(_lin(h, self.q_proj.weight), c.num_heads), cos, sin)
        k = apply_rope(self._heads(_lin(h, self.k_proj.weight), c.num_kv_heads), cos, sin)
        v = self._heads(_lin(h, self.v_proj.weight), c.num_kv_heads)
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + _lin(att.transpose(1, 2).flatten(-2), self.o_proj.weight)
        h = self.post_attention_layernorm(x)
        mlp = F.silu(_lin(h, self.gate_proj.weight)) * _lin(h, self.up_proj.weight)
        return x + _lin(mlp, self.down_proj.weight)


def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return linear(x, w)
    if x.dim() == 3 and x.shape[0] == 1:
        return linear(x[0], w).unsqueeze(0)
    return F.linear(x, w)


class DFlashModel(nn.Module):
    """The drafter's own weights; embeddings and LM head come from the target at call time."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)  # float32 frequencies, like the target's

    def init_from_target(self, target: Llama) -> None:
        """Start the layers from the target's last layers (same hidden space), fc ~ mean of taps."""
        with torch.no_grad():
            src = target.layers[-self.c.num_layers :]
            for mine, theirs in zip(self.layers, src, strict=True):
                mine.load_state_dict(theirs.state_dict())
            self.norm.weight.copy_(target.norm.weight)
            n = len(self.c.target_layers)
            eye = torch.eye(self.c.hidden_size) / n
            self.fc.weight.copy_(torch.cat([eye] * n, dim=1))
            self.mask_embedding.copy_(target.embed_tokens.weight.float().mean(0))

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos/sin [B, 1, T, hd]."""
        cos, sin = self.rotary(positions, dtype)
        return cos[:, None], sin[:, None]

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [..., taps*H] -> context features [..., H]."""
        return self.hidden_norm(_lin(taps, self.fc.weight))

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor):
        """Per layer (k, v) of context features [B, T, H] at positions [B, T]."""
        cos, sin = self.rope(positions, feats.dtype)
        return [layer.context_kv(feats, cos, sin) for layer in self.layers]

    def blocks(self, block_emb, block_pos, ctx_kv, mask=None) -> torch.Tensor:
        """Hidden states [B, Q, H] of block entries given per-layer context keys/values."""
        cos, sin = self.rope(block_pos, block_emb.dtype)
        x = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)


def save_dflash(model: DFlashModel, directory: Path, meta: dict | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / "model.safetensors")
    doc = {"ddserve_dflash": {**asdict(model.c), "target_layers": list(model.c.target_layers)}}
    if meta:
        doc["training"] = meta
    (directory / "config.json").write_text(json.dumps(doc, indent=1))


def load_draft_vocab(directory: Path | str) -> torch.Tensor | None:
    """The drafter's vocabulary subset (training/draft_vocab.py), if the directory has one."""
    path = Path(directory) / "draft_vocab.safetensors"
    return load_file(path)["token_ids"].long() if path.exists() else None


def load_dflash(directory: Path | str) -> DFlashModel:
    directory = Path(directory)
    try:
        raw = json.loads((directory / "config.json").read_text())["ddserve_dflash"]
        c = DFlashConfig(**{**raw, "target_layers": tuple(raw["target_layers"])})
        state = load_file(directory / "model.safetensors")
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise unreadable(
            "drafter.dflash_path", str(directory), "a readable DFlash drafter directory", exc
        ) from exc
    model = DFlashModel(c)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


class DFlashDrafter:
    """Engine drafter over a `DFlashModel` and the target it was trained for."""

    name = "dflash"

    def __init__(self, draft: DFlashModel, target: Llama, vocab: torch.Tensor | None = None):
        draft.c.check_target(target.cfg)
        self.net = draft.to(device=target.device, dtype=target.dtype)
        self.target = target
        self.capture = draft.c.target_layers
        self.block_size = draft.c.block_size
        # optional vocabulary subset: the LM head rows the drafter may propose
        self.vocab = vocab
        self.head = target.lm_head.weight
        if vocab is not None:
            if vocab.numel() == 0 or int(vocab.max()) >= target.cfg.vocab_size:
                raise ConfigError("the DFlash draft vocabulary has ids outside the target's")
            self.head = target.lm_head.weight[vocab.to(target.device)].contiguous()

    def new_state(self) -> None:
        return None  # the engine keeps each request's context in its DFlash pool


def block_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight per depth: earlier positions matter more (every accepted path starts there)."""
    return torch.tensor([math.exp(-i / gamma) for i in range(block_size)])
