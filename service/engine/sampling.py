"""Per-request sampling parameters, the target's token at every tree node, and the
log-probabilities of emitted tokens.

No parameter value makes sampling produce inf/nan (the engine never fails a request for
its numbers): a temperature below MIN_TEMPERATURE (or not a number) decodes greedily,
top_k <= 0 is off, and top_p keeps at least the most likely token.

`logit_bias` is added to the target's logits at every tree node before the node's token is
chosen (argmax, or a sample of softmax((logits + bias) / T) after top-k/top-p), so the
accept rule still emits exactly the biased target's tokens. Log-probabilities are *raw*,
as vLLM's default (`logprobs_mode="raw_logprobs"`): log_softmax of the target's logits
before logit_bias, temperature, top-k and top-p."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy decoding: T -> 0 is argmax in the limit, and far
# enough below it logits / T overflows float32 (softmax of inf is nan). At 1e-5 a logit gap
# of 1e-4 is already a factor e^10, so nothing a user could observe changes.
MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # alternatives per emitted token, at most (OpenAI's chat limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request, at most
MAX_ABS_BIAS = 100.0  # a bias is in [-100, 100] (OpenAI's range)


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
    # None: no log-probs (nothing is computed); k: each emitted token's raw log-prob and the
    # k most likely tokens' (0 <= k <= MAX_TOP_LOGPROBS)
    logprobs: int | None = None
    # (token id, bias) pairs, ids distinct, added to the target's logits at every tree node
    logit_bias: tuple[tuple[int, float], ...] = ()

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


def bias_vector(pairs: tuple[tuple[int, float], ...], vocab: int, device) -> torch.Tensor | None:
    """`logit_bias` as a dense float32 [V] vector to add to logits; None when empty."""
    if not pairs:
        return None
    ids, values = zip(*pairs, strict=True)
    bias = torch.zeros(vocab, dtype=torch.float32)
    bias[torch.tensor(ids, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    return bias.to(device)


@dataclass
class Logprobs:
    """Raw log-probs (log_softmax of the target's logits) of a run of emitted tokens, one
    entry per token, columnar: the emitted token's, then the k most likely tokens' (ids and
    log-probs, best first; k as the request asked, fewer only if the vocabulary is smaller)."""

    chosen: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chosen)

    def slice(self, start: int, stop: int | None = None) -> Logprobs:
        s = slice(start, stop)
        return Logprobs(self.chosen[s], self.top_ids[s], self.top_logprobs[s])

    def extend(self, other: Logprobs) -> None:
        self.chosen += other.chosen
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def to_wire(self) -> list:
        return [self.chosen, self.top_ids, self.top_logprobs]

    @classmethod
    def from_wire(cls, data: list) -> Logprobs:
        return cls(*data)


def gather_logprobs(
    logits: torch.Tensor, groups: list[tuple[list[int], list[int], int]]
) -> list[Logprobs]:
    """Raw log-probs for several requests at once: group g = (rows, tokens, k) asks for the
    log-prob of tokens[i] at logits row rows[i] and the k most likely tokens there. One
    log_softmax over the selected rows only, one device->host copy for all groups."""
    # logits: [N, V]
    dev, vocab = logits.device, logits.shape[-1]
    rows = [r for g in groups for r in g[0]]
    toks = [t for g in groups for t in g[1]]
    k = min(max(g[2] for g in groups), vocab)
    lp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=dev)).float(), -1)
    cols = [lp.gather(1, torch.tensor(toks, device=dev)[:, None]).double()]  # [M, 1]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [M, k], best first
        cols += [top_lp.double(), top_ids.double()]  # ids < 2**53: exact in float64
    host = torch.cat(cols, dim=1).cpu().tolist()  # [M, 1 + 2k]
    out, at = [], 0
    for g_rows, _, g_k in groups:
        g_k = min(g_k, vocab)
        block, at = host[at : at + len(g_rows)], at + len(g_rows)
        out.append(
            Logprobs(
                [r[0] for r in block],
                [[int(x) for x in r[1 + k : 1 + k + g_k]] for r in block],
                [r[1 : 1 + g_k] for r in block],
            )
        )
    return out


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
    draft_tokens: int = 0  # tree nodes drafted (roots excluded), as the engine built them

    @property
    def tau(self) -> float:
        """Committed tokens per verify round (SGLang's spec_accept_length)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else 0.0
