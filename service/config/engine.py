"""Config models of one engine: validated once, frozen, hashed into `system_fingerprint`.

`LiveParams` are the fields users tune while serving (tree budget, top-k, drafter window,
sampling defaults); the builtin engine swaps them between decoding rounds without reloading
weights. Everything else in `EngineConfig` needs a new engine process.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ddserve.config.base import Frozen, Text
from ddserve.config.sglang import SGLangConfig
from ddserve.errors import ConfigError

MAX_BUDGET = 256
MAX_TOPK = 64
MAX_DEPTH = 64
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5  # 0 (greedy) or at least this: logits / T must stay finite in float32


class LiveParams(Frozen):
    """Parameters that can change between decoding rounds (the reconfig controller's fields)."""

    budget: int = Field(
        8,
        ge=0,
        le=MAX_BUDGET,
        description="Draft tree size: non-root nodes verified per round; 0 = plain autoregressive decoding.",
    )
    topk: int = Field(
        4,
        ge=1,
        le=MAX_TOPK,
        description="Candidates per depth the tree may branch into; 1 = a chain.",
    )
    window: int = Field(
        2048, ge=1, le=1 << 20, description="Most recent tokens the drafter attends to."
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="Default sampling temperature; 0 = greedy.",
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Default nucleus mass in (0, 1]."
    )
    top_k: int = Field(0, ge=0, description="Default top-k sampling filter; 0 = off.")

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v


class DrafterConfig(Frozen):
    """Which drafter proposes the per-depth distributions the tree is built from."""

    kind: Literal["ngram", "dflash", "draft-model", "layer-skip", "none"] = Field(
        "ngram",
        description="ngram: prompt lookup (no weights); dflash: a block drafter conditioned on the target's hidden states (trained weights; builtin for smollm2-135m); draft-model: a smaller LM with the target's tokenizer; layer-skip: the target's first `layers` layers; none: autoregressive.",
        json_schema_extra={"flag": "--drafter"},
    )
    dflash_path: Text | None = Field(
        None,
        description="Directory of a trained DFlash drafter (config.json + model.safetensors); default: the builtin one for the model.",
    )
    depth: int = Field(
        8, ge=1, le=MAX_DEPTH, description="L: draft positions per round (tree depth limit)."
    )
    draft_model: Text | None = Field(
        None, description="Model spec of the draft model (kind=draft-model)."
    )
    layers: int = Field(
        8,
        ge=1,
        description="Target layers the layer-skip drafter keeps.",
        json_schema_extra={"flag": "--draft-layers"},
    )
    ngram_max: int = Field(
        4, ge=1, le=16, description="Longest context suffix the n-gram drafter matches."
    )
    ngram_min: int = Field(
        1, ge=1, le=16, description="Shortest context suffix the n-gram drafter matches."
    )

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        if self.kind == "draft-model" and not self.draft_model:
            raise ValueError("drafter.kind=draft-model needs drafter.draft_model (a model spec)")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min={self.ngram_min} > ngram_max={self.ngram_max}; make ngram_min <= ngram_max"
            )
        return self


class EngineConfig(Frozen):
    """Everything one engine process serves with."""

    kind: Literal["builtin", "sglang"] = Field(
        "builtin", description="builtin: ddserve's PyTorch DDTree engine; sglang: an SGLang server."
    )
    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs per engine (tensor parallel size); the replica reserves that many.",
    )
    sglang: SGLangConfig | None = Field(None, description="SGLang launch settings (kind=sglang).")
    restart_fields: list[Text] = Field(
        default_factory=list,
        description="Live parameters this deployment always changes by restarting engines (SGLang adds budget, topk, window itself).",
    )

    model: Text = Field(
        "smollm2-135m",
        description="Model spec: 'smollm2-135m' (bundled GGUF), 'tiny-random[:seed]', a Hugging Face model directory (Llama, Mistral or Qwen2: config.json, safetensors, tokenizer), a .gguf file or a directory saved by ddserve.",
    )
    served_name: Text | None = Field(
        None,
        description="Model id in the OpenAI API; defaults to `model`.",
        json_schema_extra={"flag": "--served-model-name", "aliases": ["--served-name"]},
    )
    drafter: DrafterConfig = Field(
        default_factory=DrafterConfig,
        description="The drafter (its fields are flags of their own).",
    )
    params: LiveParams = Field(
        default_factory=LiveParams,
        description="Live parameters (their fields are flags of their own).",
    )
    max_context: int | None = Field(
        None, ge=2, description="Longest prompt + completion; defaults to the model's own limit."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on GPU."
    )
    max_batch: int = Field(
        32,
        ge=1,
        le=1024,
        description="Requests verified together in one target forward per round (continuous batching).",
    )
    graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="CUDA graphs: the engine's fixed-shape forwards (KV pool of max_batch slots) captured and replayed on a GPU. auto and on = on with CUDA; off = eager. On CPU the same engine always runs eagerly.",
    )
    spec_max_batch: int | None = Field(
        None,
        ge=0,
        description="Rounds with more active requests than this run without a draft (budget 0): at large batches verify compute, not launches, bounds a step and speculation costs more than it saves. None = always speculate.",
    )
    speculative_adaptive: bool = Field(
        False,
        description="Each round's draft budget follows the live batch: the live budget is the ceiling, and a round drafts the budget (0 = none, the widths below the ceiling, or the ceiling) with the most tokens per second as measured on this engine's own rounds at that batch size (ddserve.engine.adaptive). Builtin engine; spec_max_batch still applies.",
        json_schema_extra={"flag": "--speculative-adaptive"},
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the static engine's decoder layers (fused kernels; compiled once at start-up, cached on disk by inductor). auto = on with CUDA.",
    )
    attention_backend: Literal["auto", "sdpa", "triton"] = Field(
        "auto",
        description="The static engine's attention: triton = one kernel that reads only the keys each request has (tree, causal and windowed masks); sdpa = the reference (torch's scaled_dot_product_attention over a padded key range). auto = triton with CUDA when triton imports, else sdpa.",
        json_schema_extra={"flag": "--attention-backend"},
    )
    fused_layers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode and verify forwards of at most 16 rows (B x W) run each decoder layer as four triton kernels plus attention (RMSNorm + QKV + RoPE + KV write; O projection + residual; RMSNorm + gate/up + SiLU; down projection + residual) instead of torch's ~13: at a few rows a step is bound by kernel launches (measured on an H200: 6% faster per step at 1 row; even at 64, so wider forwards keep torch). auto = on with CUDA in bf16 when triton imports (the DFlash drafter keeps torch's layers); on elsewhere needs triton's interpreter (tests).",
        json_schema_extra={"flag": "--fused-layers"},
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of the GPU's memory the engine may fill (vLLM's flag): the KV pool takes what the weights leave of it, at most --max-batch slots of --max-context; fewer slots if they do not fit (logged; more requests wait for a free one), an error at start if not even one does. Unused on CPU, where the pool's pages take memory only once written.",
        json_schema_extra={"flag": "--gpu-memory-utilization"},
    )
    chunked_prefill_size: int = Field(
        2048,
        ge=-1,
        description="Most prompt tokens prefilled per round while other requests are decoding, so a long prompt is admitted in chunks between their rounds instead of stalling them (SGLang's --chunked-prefill-size). A prompt arriving to an idle engine is prefilled whole unless the engine's own timed prefills say that takes over 0.5 s (then this many tokens a round, so a request arriving meanwhile waits for one chunk); until one is timed, a prompt longer than this takes one chunk first. -1 or 0 = no limit.",
        json_schema_extra={"flag": "--chunked-prefill-size"},
    )
    chunked_prefill_steps: float = Field(
        1.5,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="While requests decode, a round's prompt chunk is sized to take about this many of their decode steps, measured on this engine's own rounds (ddserve.engine.prefill_pacing), within --chunked-prefill-size: a round that admits a long prompt then takes about 1 + this many steps, whatever the model, GPU or context length. The default keeps running streams' ITL p99 under 3x their p50 while a long prompt is admitted (on an H200, 2.5-2.6x at 1.5 against 3.0-3.7x at 2); 2 admits long prompts sooner (a 7,200-token prompt's first token ~35% earlier; 16 concurrent ~2,900-token prompts 0.47x of short prompts' throughput against 0.37x). 0 = the token cap alone.",
        json_schema_extra={"flag": "--chunked-prefill-steps"},
    )
    overlap_prefill: Literal["auto", "on", "off"] = Field(
        "auto",
        description="While requests decode, a round's prompt chunk runs on a CUDA stream of its own, beside their decode step (on a stream of high priority), instead of before it: both forwards are mostly launch-bound at these sizes and fill each other's idle multiprocessors, so the round takes about the longer of the two, not their sum, and --chunked-prefill-steps sizes the chunk to 1 + that many steps (a serial round's length). A prompt whose last chunk ran so is decoded from the next round. On an H200, 16 streams of ~2,900-token prompts: 1.17-1.36x the throughput of chunks before the step, a long prompt's first token ~40% sooner. auto = on with CUDA; on elsewhere keeps the order (one round later) with nothing to overlap (tests).",
        json_schema_extra={"flag": "--overlap-prefill"},
    )
    num_scheduler_steps: int = Field(
        1,
        ge=1,
        le=64,
        description="Decoding steps per host round trip of the builtin engine (vLLM's --num-scheduler-steps): without a drafter each step's token feeds the next on the device; with a DFlash drafter whose trees the GPU builds, that many draft + verify rounds run back to back with the accept on the device. The round's tokens come back in one copy, so the host's work of a step (reading it back, accepting, packing and launching the next) is paid once. The same tokens as one-step rounds; tokens arrive that many steps at a time, a request that ends inside them waits for the last ones, and one step is taken while prompts wait to join, for a request's first token (unless --first-token-share lets it wait for the trip) and when a request asks for log-probs; a DFlash engine's budget-0 rounds (adaptive speculation at a large batch, --spec-max-batch) take that many plain steps. Other drafters take one round. On an H100 (SmolLM2, b15/k4, bench/NOTES.md twenty-eighth session): 4 steps made DDTree 1.19x at C=1 in-process, 1.15x / 1.22x at C=1 / 4 through `ddserve engine`, and AR 1.25x / 1.33x / 1.66x at C=1 / 16 / 64.",
        json_schema_extra={"flag": "--num-scheduler-steps"},
    )
    first_token_share: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="With --num-scheduler-steps N > 1: a trip takes one step (not N) while the requests awaiting their first token are more than this share of its requests. 0 = any one of them: a newcomer's first token comes after one step, and every decoding request in that trip pays a host round trip for it. 0.5 = a few newcomers beside many decoding requests wait for the trip's N steps (their first token up to N - 1 rounds later) while a batch of more than half new requests still takes one step (1 = never one step for a first token, even for a request alone). A prompt joining still makes its trip one step. Requests that end at different rounds (sampling, speculation) join one by one, so at 0 most trips of a busy engine take one step. On an H100 (SmolLM2, adaptive b15/k4, 4 steps, bench/NOTES.md twenty-ninth session) 0.5 made 1.08x / 1.05x the throughput of 0 at 16 / 64 concurrent requests (rounds a trip 2.2 -> 2.6, 1.4 -> 1.6) for a first token 1.1x / 1.3x later (p50).",
        json_schema_extra={"flag": "--first-token-share"},
    )
    decode_log_interval: int = Field(
        40,
        ge=0,
        description="Every this many engine rounds the builtin engine logs one line (SGLang's --decode-log-interval and its 'Decode batch.' line): running and queued requests, generated tokens per second, and those rounds' mean times: rounds that only decode, and rounds that prefill a chunk of joining prompts (the chunk, its prompt tokens, then the decode step). 0 = no such line.",
        json_schema_extra={"flag": "--decode-log-interval"},
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=1024,
        description="Tokens per streamed chunk (SGLang's and vLLM's --stream-interval): the first token is sent at once, then a chunk once this many more are out, and the last one at once. Larger values cut the server's work per token (JSON, HTTP writes, Ray's proxy) about that many times; clients see text in steps of that many tokens. 1 = a chunk per engine round. Done in ddserve's API for every engine kind (SGLang's own flag counts tokens differently under speculation: set it through sglang.extra_args if wanted).",
        json_schema_extra={"flag": "--stream-interval"},
    )

    @model_validator(mode="after")
    def _engine_rules(self) -> EngineConfig:
        unknown = set(self.restart_fields) - set(LiveParams.model_fields)
        if unknown:
            raise ValueError(
                f"restart_fields {sorted(unknown)} are not live parameters; choose from {sorted(LiveParams.model_fields)}"
            )
        if self.kind == "sglang":
            if self.sglang is None:
                raise ValueError(
                    "engine.kind=sglang needs an `sglang:` section (at least the drafter path)"
                )
            if self.params.window < self.sglang.block_size:
                raise ValueError(
                    f"params.window={self.params.window} is below the DFlash block size {self.sglang.block_size}; "
                    "SGLang rejects --speculative-draft-window-size < --speculative-num-draft-tokens"
                )
        elif self.tp_size != 1:
            raise ValueError(
                f"tp_size={self.tp_size}: the builtin engine runs on one device; use kind=sglang for tensor parallelism"
            )
        return self

    @property
    def model_id(self) -> str:
        return self.served_name or self.model

    def fingerprint(self) -> str:
        """Short hash of everything that changes what the engine serves (`dtype: auto`
        means float32 on CPU, bfloat16 on GPU: the same config hashes the same anywhere)."""
        payload = {
            "kind": self.kind,
            "sglang": self.sglang.model_dump() if self.sglang else None,
            "tp_size": self.tp_size,
            "model": self.model,
            "drafter": self.drafter.model_dump(),
            "params": self.params.model_dump(),
            "dtype": self.dtype,
            "max_context": self.max_context,
        }
        # serving the same tokens, but a different process: a restart that only changes these
        # must be told apart by the reconfig controller's verification (absent = the default,
        # so fingerprints of configs without them do not move)
        if self.speculative_adaptive:
            payload["speculative_adaptive"] = True
        if self.spec_max_batch is not None:
            payload["spec_max_batch"] = self.spec_max_batch
        if self.stream_interval != 1:
            payload["stream_interval"] = self.stream_interval
        if self.num_scheduler_steps != 1:
            payload["num_scheduler_steps"] = self.num_scheduler_steps
        if self.first_token_share:
            payload["first_token_share"] = self.first_token_share
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return "fp_" + digest[:10]

    def with_params(self, **changes) -> EngineConfig:
        """A new config with some live parameters changed, validated like the original."""
        merged = {**self.params.model_dump(), **changes}
        return self.model_copy(update={"params": validate(LiveParams, merged)})


def validate(model: type[BaseModel], data: dict) -> BaseModel:
    """Validate `data` into `model`; on failure raise ConfigError with one readable line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc), param=_first_loc(exc)) from exc


def _first_loc(exc: ValidationError) -> str | None:
    errs = exc.errors()
    return ".".join(str(p) for p in errs[0]["loc"]) if errs and errs[0]["loc"] else None


def describe_validation_error(exc: ValidationError) -> str:
    """'field=value: what is allowed' for the first error (the rest follow, ';'-separated)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field")
        elif "input" in err and not isinstance(err["input"], dict):
            parts.append(f"{loc}={err['input']!r}: {msg}")
        else:
            parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
