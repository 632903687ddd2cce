"""From an EngineConfig to the engine the runner drives (ddserve.engine.runner): the device
and dtype, the target's weights, the drafter, the static engine over them."""

from __future__ import annotations

import torch

from ddserve.config.engine import EngineConfig
from ddserve.engine.drafters import Drafter, ModelDrafter, NGramDrafter, NoDrafter
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import LoadedModel, load_model
from ddserve.errors import ConfigError, EngineUnavailable


def resolve_device(config: EngineConfig) -> tuple[str, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineUnavailable("device=cuda but no CUDA device is visible")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, getattr(torch, dtype)


def build_drafter(
    config: EngineConfig, target: LoadedModel, device: str, dtype: torch.dtype
) -> Drafter:
    d = config.drafter
    if d.kind == "none":
        return NoDrafter()
    if d.kind == "ngram":
        return NGramDrafter(target.model.cfg.vocab_size, d.ngram_max, d.ngram_min)
    if d.kind == "dflash":
        from ddserve.engine.dflash import BUILTIN, DFlashDrafter, load_dflash, load_draft_vocab

        path = d.dflash_path or BUILTIN.get(config.model)
        if path is None:
            raise ConfigError(
                f"drafter.kind=dflash: no builtin DFlash drafter for model {config.model!r}; set drafter.dflash_path (train one with python -m ddserve.training.dflash)",
                param="drafter.dflash_path",
            )
        return DFlashDrafter(load_dflash(path), target.model, load_draft_vocab(path))
    if d.kind == "layer-skip":
        if d.layers >= target.model.cfg.num_layers:
            raise ConfigError(
                f"drafter.layers={d.layers}: must be below the target's {target.model.cfg.num_layers} layers",
                param="drafter.layers",
            )
        return ModelDrafter(target.model, d.layers, name="layer-skip")
    draft = load_model(d.draft_model, device, dtype, with_tokenizer=False).model
    if draft.cfg.vocab_size != target.model.cfg.vocab_size:
        raise ConfigError(
            f"drafter.draft_model={d.draft_model!r} has vocab {draft.cfg.vocab_size}, the target {target.model.cfg.vocab_size}: they must share a tokenizer",
            param="drafter.draft_model",
        )
    return ModelDrafter(draft)


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None
) -> tuple[StaticEngine, object, int]:
    """(the StaticEngine, the tokenizer, the context limit) for `config`; `loaded`: the
    target's weights already in memory (else loaded from `config.model`)."""
    device, dtype = resolve_device(config)
    loaded = loaded or load_model(config.model, device, dtype)
    model = loaded.model.to(device=device, dtype=dtype)
    drafter = build_drafter(config, loaded, device, dtype)
    limit = model.cfg.max_position
    if config.max_context is not None and config.max_context > limit:
        raise ConfigError(
            f"max_context={config.max_context} exceeds the model's own limit of {limit} "
            "tokens (its position embeddings were trained to there); lower --max-context",
            param="max_context",
        )
    max_context = config.max_context or limit
    cuda = device == "cuda"
    engine = StaticEngine(
        model,
        drafter,
        config.drafter.depth,
        model.cfg.eos_token_ids,
        slots=config.max_batch,
        max_context=max_context,
        graphs=config.graphs != "off" and cuda,
        compile=config.compile == "on" or (config.compile == "auto" and cuda),
        attention=config.attention_backend,
        fused_layers=config.fused_layers,
        memory_fraction=config.gpu_memory_utilization,
        scheduler_steps=config.num_scheduler_steps,
    )
    return engine, loaded.tokenizer, max_context
