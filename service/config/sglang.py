"""How to launch SGLang (engine kind `sglang`): its interpreter, drafter, and the names its
build takes the DDTree parameters under (ddserve.config.sglang_presets)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ddserve.config.base import ENV_NAME, Frozen, Text
from ddserve.config.sglang_presets import (
    PRESETS,
    TREE_PARAMS,
    UPSTREAM_WINDOW_FLAG,
    DDTreeMapping,
)


class SGLangConfig(Frozen):
    """How to launch SGLang (engine kind `sglang`). SGLang cannot run on CPU machines.

    The DDTree parameters reach SGLang as flags or variables named by `preset`
    (ddserve.config.sglang_presets), or, without one, by `speculative_algorithm`,
    `ddtree_flags` and `ddtree_env`."""

    python: Text = Field("python3", description="Python interpreter that has sglang installed.")
    draft_model_path: Text | None = Field(
        None, description="DFlash drafter checkpoint (--speculative-draft-model-path)."
    )
    preset: Text | None = Field(
        None,
        description=f"Named DDTree flag set of an SGLang build: {', '.join(PRESETS)} (see ddserve.config.sglang_presets). Sets the algorithm, flags and variables; then leave speculative_algorithm, ddtree_flags and ddtree_env out.",
    )
    speculative_algorithm: Text = Field(
        "DFLASH",
        description="--speculative-algorithm (DFLASH in upstream 0.5.23); without a preset.",
    )
    block_size: int = Field(
        16, ge=1, description="DFlash block size: --speculative-num-draft-tokens."
    )
    ddtree_flags: dict[Text, Text] = Field(
        default_factory=lambda: {
            "budget": "--speculative-ddtree-budget",
            "topk": "--speculative-ddtree-topk",
        },
        description=f"Without a preset: flag names of budget/topk/window in your SGLang build (forks differ; upstream 0.5.23 has none for budget/topk). Empty = do not pass them; the window defaults to {UPSTREAM_WINDOW_FLAG}.",
    )
    ddtree_env: dict[Text, Text] = Field(
        default_factory=dict,
        description="Without a preset: budget/topk/window passed as environment variables of the SGLang process instead, e.g. {topk: SGLANG_DDTREE_MAX_TOPK}.",
    )
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="--mem-fraction-static")
    context_length: int | None = Field(None, ge=2, description="--context-length")
    extra_args: list[Text] = Field(
        default_factory=list, description="Appended verbatim to the launch command."
    )
    tokenizer_path: Text | None = Field(
        None, description="Tokenizer for chat templates in the replica; default: the model path."
    )

    @model_validator(mode="after")
    def _flags(self) -> SGLangConfig:
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(
                    f"preset={self.preset!r} is unknown; choose from {', '.join(PRESETS)}"
                )
            spelled = {
                "speculative_algorithm",
                "ddtree_flags",
                "ddtree_env",
            } & self.model_fields_set
            if spelled:
                raise ValueError(
                    f"preset={self.preset} names the algorithm, flags and variables; drop {', '.join(sorted(spelled))} or drop the preset"
                )
        for name, mapping in (("ddtree_flags", self.ddtree_flags), ("ddtree_env", self.ddtree_env)):
            unknown = set(mapping) - set(TREE_PARAMS)
            if unknown:
                raise ValueError(
                    f"{name} keys {sorted(unknown)} are unknown; use {', '.join(TREE_PARAMS)}"
                )
        bad = [f for f in self.ddtree_flags.values() if not f.startswith("--")]
        if bad:
            raise ValueError(f"ddtree_flags values {bad} must be long flags starting with '--'")
        bad = [v for v in self.ddtree_env.values() if not ENV_NAME.fullmatch(v)]
        if bad:
            raise ValueError(f"ddtree_env values {bad} must be environment variable names")
        both = set(self.ddtree_flags) & set(self.ddtree_env)
        if both and "ddtree_flags" in self.model_fields_set:
            raise ValueError(f"{sorted(both)} are in both ddtree_flags and ddtree_env; keep one")
        return self

    @property
    def mapping(self) -> DDTreeMapping:
        """The names this build takes budget/topk/window under (the preset's, or spelled out)."""
        if self.preset is not None:
            return PRESETS[self.preset]
        # a parameter in ddtree_env is not also passed by the default ddtree_flags
        flags = {k: v for k, v in self.ddtree_flags.items() if k not in self.ddtree_env}
        if "window" not in flags and "window" not in self.ddtree_env:
            flags["window"] = UPSTREAM_WINDOW_FLAG
        return DDTreeMapping(self.speculative_algorithm, flags, dict(self.ddtree_env))
