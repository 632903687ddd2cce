"""Hugging Face model directories, read as they are: which architectures `Llama` reproduces
exactly (SUPPORTED; anything else is refused in one line that names it), their config.json
as a `LlamaConfig`, their safetensors weights (one file or shards) and their tokenizer.

What is refused and why: other architectures (different layers or norms); a RoPE scaling
type other than linear and llama3 (yarn, longrope, dynamic change the frequencies per length
or the attention scale: outputs would be wrong, not approximate); sliding-window attention
(our layers attend to the whole context); a non-SiLU MLP, MLP biases, an o_proj bias.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ddserve.engine.llama import ROPE_TYPES, Llama, LlamaConfig
from ddserve.errors import ConfigError

# model_type -> the transformers class whose weights and forward `Llama` reproduces exactly
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",  # without a sliding window
    "qwen2": "Qwen2ForCausalLM",  # q/k/v biases; without a sliding window
}
# the parameters of each RoPE scaling type `rope_inv_freq` implements
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}


def hf_weight_name(key: str) -> str | None:
    """A transformers parameter name -> ours (model.layers.0.self_attn.q_proj.weight ->
    layers.0.q_proj.weight); None for a buffer we compute ourselves (RoPE frequencies)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    return key.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")


def check_architecture(model_type: object, architectures: object) -> None:
    """Refuse, in one line, a model whose architecture `Llama` does not reproduce."""
    archs = list(architectures) if isinstance(architectures, list) else []
    if model_type in SUPPORTED and all(a == SUPPORTED[model_type] for a in archs):
        return
    named = f"model_type={model_type!r}" + (f" (architectures {archs})" if archs else "")
    raise ConfigError(
        f"{named} is not supported; the builtin engine runs {', '.join(SUPPORTED.values())}"
    )


def rope_scaling_of(hf_cfg) -> dict | None:
    """transformers' rope_parameters -> LlamaConfig.rope_scaling; a type we do not implement
    is refused by name (its frequencies or attention scale would differ: wrong outputs)."""
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    legacy = getattr(hf_cfg, "rope_scaling", None)  # transformers < 5, or a GGUF's config
    if not rope.get("rope_type") and isinstance(legacy, dict):
        rope.update(legacy)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported; the builtin engine implements "
            f"{', '.join(ROPE_TYPES)}"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor below 1 is not supported (RoPE on every dim)")
    if kind == "default":
        return None
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings", hf_cfg.max_position_embeddings)
    try:
        return {"rope_type": kind, **{k: float(rope[k]) for k in ROPE_KEYS[kind]}}
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"rope_scaling {kind!r} needs {', '.join(ROPE_KEYS[kind])}") from exc


def check_layers(hf_cfg) -> None:
    """Refuse what the decoder layers would compute differently from ours."""
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf_cfg.hidden_act!r} is not supported (SiLU only)")
    if getattr(hf_cfg, "model_type", "") != "qwen2" and getattr(hf_cfg, "attention_bias", False):
        raise ConfigError("attention_bias=true is not supported (an o_proj bias); Qwen2's is")
    if getattr(hf_cfg, "mlp_bias", False):
        raise ConfigError("mlp_bias=true is not supported")
    window = getattr(hf_cfg, "sliding_window", None)
    layer_types = getattr(hf_cfg, "layer_types", None) or ()
    if (window and window < hf_cfg.max_position_embeddings) or any(
        t != "full_attention" for t in layer_types
    ):
        raise ConfigError(
            f"sliding-window attention (sliding_window={window}) is not supported; "
            "every layer must attend to the whole context"
        )


def config_from_hf(hf_cfg, tokenizer=None, extra_eos: tuple[int, ...] = ()) -> LlamaConfig:
    model_type = getattr(hf_cfg, "model_type", "llama")
    check_architecture(model_type, getattr(hf_cfg, "architectures", None))
    check_layers(hf_cfg)
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    eos = hf_cfg.eos_token_id
    eos = [*(eos if isinstance(eos, list) else [eos]), *extra_eos]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return LlamaConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size,
        num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads,
        num_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads,
        head_dim=getattr(hf_cfg, "head_dim", None)
        or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        rope_theta=float(theta),
        rms_eps=float(hf_cfg.rms_norm_eps),
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        max_position=hf_cfg.max_position_embeddings,
        bos_token_id=hf_cfg.bos_token_id,
        eos_token_ids=tuple(sorted({e for e in eos if e is not None})),
        qkv_bias=model_type == "qwen2",
        rope_scaling=rope_scaling_of(hf_cfg),
    )


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face directory: the shards its index lists, else
    model.safetensors, else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index.name}: not a safetensors index ({exc})") from exc
        return [directory / s for s in shards]
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            "a Hugging Face model directory needs its weights as *.safetensors "
            "(pytorch_model.bin is not read)"
        )
    return files


def load_hf_directory(
    directory: Path, raw_config: dict, dtype: torch.dtype, *, with_tokenizer: bool = True
) -> tuple[Llama, object | None]:
    """A Hugging Face model directory as it is on disk, nothing converted or cached: the
    config through transformers' AutoConfig, the weights shard by shard straight into a
    `Llama` (each tensor cast to `dtype` as it is read), the tokenizer and its chat template
    (tokenizer_config.json or chat_template.jinja) through AutoTokenizer; all local."""
    check_architecture(raw_config.get("model_type"), raw_config.get("architectures"))
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"config.json: transformers cannot read it ({exc})") from exc
    tok = None
    if with_tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"the model directory has no readable tokenizer ({exc})") from exc
    cfg = config_from_hf(hf_cfg, tok, generation_eos(directory))
    with torch.device("meta"):  # no random init and no second copy of the weights
        model = Llama(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    loaded: set[str] = set()
    for path in safetensors_files(directory):
        state, unexpected = {}, []
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    name = hf_weight_name(key)
                    if name is None or (cfg.tie_embeddings and name == "lm_head.weight"):
                        continue  # recomputed, or the embedding matrix a second time
                    if name not in expected:
                        unexpected.append(key)
                        continue
                    state[name] = f.get_tensor(key).to(dtype)
            if unexpected:
                raise ConfigError(
                    f"{path.name}: weights a {SUPPORTED[hf_cfg.model_type]} does not have: "
                    f"{unexpected[:3]}"
                )
            model.load_state_dict(state, strict=False, assign=True)
        except (OSError, RuntimeError, SafetensorError) as exc:
            raise ConfigError(f"{path.name}: cannot load it ({exc})") from exc
        loaded |= state.keys()
    if missing := sorted(expected - loaded):
        raise ConfigError(f"the model directory lacks {len(missing)} weights: {missing[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval(), tok


def generation_eos(directory: Path) -> tuple[int, ...]:
    """The end-of-turn ids generation_config.json adds (Llama 3 Instruct: <|eot_id|> ...)."""
    try:
        eos = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(e for e in ids if isinstance(e, int))
