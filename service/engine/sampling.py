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

import numpy as np
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


@dataclass
class SampleGroup:
    """One request's rows of a forward to sample: rows [row, row + n), its parameters, its
    logit_bias as a [V] vector (or None) and its random generator."""

    row: int
    n: int
    params: SamplingParams
    bias: torch.Tensor | None
    generator: torch.Generator | None


def sample_inputs(groups: list[SampleGroup]) -> np.ndarray:
    """The rows and per-row parameters of `groups`, packed for one host->device copy:
    float32 [R, 4] = (row, temperature, top_p, top_k) (rows of a forward are far below
    2^24: exact)."""
    out = np.empty((sum(g.n for g in groups), 4), dtype=np.float32)
    at = 0
    for g in groups:
        out[at : at + g.n, 0] = np.arange(g.row, g.row + g.n)
        out[at : at + g.n, 1:] = (g.params.temperature, g.params.top_p, g.params.top_k)
        at += g.n
    return out


def sample_rows(
    logits: torch.Tensor, groups: list[SampleGroup], inputs: torch.Tensor | None = None
):
    """The target's sampled token at the rows of several requests at once, on the device and
    with no sync (the engine reads them back with the verify's argmax, in one copy):
    (rows [R], tokens [R], ok [R]). Each request keeps its own temperature, top-k, top-p,
    bias and generator; `ok` is False at a row whose distribution is not finite (a request
    that fails there fails alone). Sampling is the exponential race: with E_i ~ Exp(1) drawn
    by the request's generator, argmax_i p_i / E_i is token i with probability p_i — the same
    distribution as a multinomial draw, for every row at once. `inputs`: sample_inputs(groups)
    already on the device (the engine copies it without a sync), else copied here."""
    # logits: [N, V]  inputs: [R, 4]
    dev, vocab = logits.device, logits.shape[-1]
    if inputs is None:
        inputs = torch.from_numpy(sample_inputs(groups)).to(dev)
    rows = inputs[:, 0].long()
    lg = logits.index_select(0, rows)  # [R, V]
    if lg.dtype != torch.float32:
        lg = lg.float()
    at = 0
    for g in groups:
        if g.bias is not None:
            lg[at : at + g.n] += g.bias
        at += g.n
    top_k = any(0 < g.params.top_k < vocab for g in groups)
    top_p = any(g.params.top_p < 1.0 for g in groups)
    probs = filtered_probs_rows(lg, inputs[:, 1:], top_k, top_p)
    race = torch.empty_like(probs)
    at = 0
    for g in groups:
        race[at : at + g.n].exponential_(generator=g.generator)
        at += g.n
    tokens = (probs / race.clamp_min_(1e-30)).argmax(-1)
    mass = probs.sum(-1)  # nan where any probability is (each is <= 1 otherwise)
    return rows, tokens, (mass == mass) & (mass > 0)


class BatchSampler:
    """sample_rows for the engine's verify: `into(top, logits, groups)` turns the verify's
    [2, N] (argmax, finite) into [3, N] — the sampled requests' rows hold their samples, the
    new row whether each sample's distribution was finite (1 elsewhere) — so one device->host
    copy brings every request's tokens back. The packed inputs go up through `staging`
    (ddserve.engine.static.Staging: a pinned buffer, no sync) into a buffer made once for
    `max_rows` rows."""

    def __init__(self, max_rows: int, staging):
        self.max_rows, self.staging = max_rows, staging
        self.buf: torch.Tensor | None = None

    def into(self, top: torch.Tensor, logits: torch.Tensor, groups: list[SampleGroup]):
        rows, tokens, ok = sample_rows(logits, groups, self.staged(groups, logits.device))
        top = torch.cat([top, torch.ones_like(top[:1])])
        top[0, rows] = tokens
        top[2, rows] = ok.long()
        return top

    def staged(self, groups: list[SampleGroup], device) -> torch.Tensor:
        """sample_inputs(groups) on the device, copied up without a sync: [R, 4]."""
        packed = sample_inputs(groups)
        if self.buf is None:
            self.buf = torch.zeros(self.max_rows * 4, dtype=torch.float32, device=device)
        self.staging.copy(self.buf, packed)
        return self.buf[: packed.size].view(-1, 4)


def filtered_probs_rows(
    logits: torch.Tensor, params: torch.Tensor, top_k: bool, top_p: bool
) -> torch.Tensor:
    """`filtered_probs` with each row's own parameters: params [R, 3] = (temperature, top_p,
    top_k) per row; `top_k`/`top_p`: whether any row filters so (known on the host: no sync).
    Row for row the same distribution as `filtered_probs` with that row's values."""
    # logits: [R, V]  params: [R, 3]
    vocab = logits.shape[-1]
    logits = logits / params[:, :1]
    if top_k:  # keep logits >= the row's k-th largest (ties at the k-th kept), k off at 0 or >= V
        k = params[:, 2].long()
        on = (k > 0) & (k < vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(
            1, (k.clamp(1, vocab) - 1)[:, None]
        )
        kth = torch.where(on[:, None], kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p:  # the smallest prefix whose mass reaches the row's top_p (the first always stays)
        p = params[:, 1:2]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = ((sorted_p.cumsum(-1) - sorted_p) >= p) & (p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        kept = probs.masked_fill(drop, 0.0)
        probs = torch.where(p < 1.0, kept / kept.sum(-1, keepdim=True), probs)
    return probs


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
    # seconds from the engine's receipt of the request (0 = not reported, as by SGLang): to
    # its prompt's first prefill forward, to its first token, to its last
    queue_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0

    @property
    def tau(self) -> float:
        """Committed tokens per verify round (SGLang's spec_accept_length)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else 0.0
