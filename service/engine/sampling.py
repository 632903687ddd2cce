"""Per-request sampling parameters and the target's token at every tree node.

No parameter value makes sampling produce inf/nan (the engine never fails a request for
its numbers): a temperature below MIN_TEMPERATURE (or not a number) decodes greedily,
top_k <= 0 is off, and top_p keeps at least the most likely token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy decoding: T -> 0 is argmax in the limit, and far
# enough below it logits / T overflows float32 (softmax of inf is nan). At 1e-5 a logit gap
# of 1e-4 is already a factor e^10, so nothing a user could observe changes.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Resolved per-request sampling (defaults filled in from the engine's LiveParams)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, anything below MIN_TEMPERATURE, or NaN."""
        return not self.temperature >= MIN_TEMPERATURE


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int
) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T), then top-k, then top-p. [N, V]."""
    # logits: [N, V]
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[:, 0] = False  # even at top_p <= 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def target_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """The target's token at every node: argmax at T=0, else an independent sample. [N]."""
    # logits: [N, V]
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, params.temperature, params.top_p, params.top_k)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class RequestStats:
    """Per-request statistics, as data (the server turns them into metrics)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # committed tokens per round

    @property
    def tau(self) -> float:
        """Committed tokens per verify round (SGLang's spec_accept_length)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else 0.0
