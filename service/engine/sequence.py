"""One request's decoding state and its stop rule, shared by the engine and the tests'
reference engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddserve.engine.sampling import Logprobs, RequestStats, SamplingParams

# one sequence's result of a round: its new tokens, or the exception that ended it; a call
# of several rounds (num_scheduler_steps) that fails in a later round also commits the
# earlier rounds' tokens, which the exception carries (`ended_after`, `tokens_before`) for
# delivery before it, as one-round calls would have streamed them
Outcome = list[int] | Exception


def ended_after(exc: Exception, tokens: list[int]) -> Exception:
    """`exc`, carrying the tokens its call committed before it (the runner delivers them)."""
    exc.tokens_before = list(tokens)
    return exc


def tokens_before(exc: Exception) -> list[int]:
    """The tokens a failed call committed before its failure (`ended_after`), else none."""
    return getattr(exc, "tokens_before", [])


@dataclass
class Sequence:
    """Decoding state of one request."""

    prompt: list[int]
    sampling: SamplingParams
    cache: object  # the engine's KV handle for this request
    draft_state: object
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # committed context; tokens[-1] is the root
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # target layer outputs of committed tokens the drafter has not seen yet (DFlash)
    hidden_new: list[torch.Tensor] = field(default_factory=list)
    tree_hidden: torch.Tensor | None = None  # the last verify's tapped outputs, all nodes
    bias: torch.Tensor | None = None  # sampling.logit_bias as a dense [V] vector, or None
    # raw log-probs of `output`, entry for entry, when sampling.logprobs asks for them
    logprobs: Logprobs | None = None
    # node indices of the accepted path (ascending: parents precede children) of each round
    # the last engine call took (several where rounds ran back to back: static_spec); a
    # best-first tree of budget b is the first b nodes of a bigger one, so a path says what a
    # smaller budget would have accepted (adaptive speculation's estimates)
    last_paths: list[list[int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def truncate_at_stop(seq: Sequence, new: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """`new` up to and including the first stop token or the `max_tokens` limit; sets
    `seq.finish_reason` when it stops."""
    sp = seq.sampling
    for i, tok in enumerate(new):
        if (tok in eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            seq.finish_reason = "stop"
            return new[: i + 1]
        if len(seq.output) + i + 1 >= sp.max_tokens:
            seq.finish_reason = "length"
            return new[: i + 1]
    return new
