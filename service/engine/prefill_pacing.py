"""Chunked prefill paced by time (the runner's admission of long prompts, issue 18).

While requests decode, every round that also prefills a newcomer's prompt makes them wait for
that prefill: a 2,048-token chunk at ~5k keys cost ~10 ms next to a ~2 ms decode step on the
H200, so the running streams saw an 8x gap. A fixed token cap (`--chunked-prefill-size`, as
SGLang's) cannot fit every model, GPU and context length; here the chunk is sized from this
engine's own measured rounds instead, to take about `steps` decode steps (the target):

  * chunks taken while others decoded are measured by size class (a power of two of tokens);
    within a class, time is a line over the chunk's context (the keys before it: a later
    chunk of a long prompt reads more of them), fitted to its recent chunks (older ones
    weigh less; a class not measured lately is dropped);
  * the next chunk's size is read off the classes at that chunk's context, bracketing the
    target: between the largest that takes at most the target and the next larger one that
    takes more, on the line through the two; where nothing larger was measured, on the line
    through the two largest that fit (or at the last slope between sizes seen), else twice
    the largest that fits (a chunk's time grows at most in proportion to its size, so that
    round takes at most 2x the target, and then the bracket is known); where nothing fits,
    the smallest size scaled down to the target.

No cost model across sizes is assumed: under CUDA graphs a chunk forward costs ~1.2 ms
whatever its width on the H200, ~3.3 us a token more at ~3k keys. Sizing by time per token
alone (the thirteenth session's pacer) read a 256-token chunk's ~2 ms as 7.8 us a token and
asked for ~384 tokens, which the engine, taking the widest chunk width within a budget, took
as 256 again: 16 prompts of ~2,900 tokens went in 256 tokens a round, every round prefilled,
and their throughput was 0.32x of short prompts'; a 512-token chunk (~2.9 ms) fitted 1.5
steps. A fixed + per-token line fitted across sizes (the fourteenth session's first try) was
misled by bursts of short prompts (8 a forward: twice the tokens in two forwards, a line
through 0). Counted are only chunks that filled most of their budget and ended no prompt: a
prompt's last chunk runs padded to a wider shape (530 tokens as 1,024), a short prompt alone
costs a chunk's time for fewer tokens; a slow chunk counts as at most SPIKE_CHUNK x what its
class predicts.

A round that prefills then takes about 1 + `steps` decode steps (with the chunk beside the
step on its own CUDA stream, --overlap-prefill, the round takes about the chunk's time alone:
the chunk may then take 1 + `steps` steps, `beside`, and is timed on the GPU; a step beside
a chunk is not timed as a plain one, so one round in REFRESH + 1 steps alone); of several
prompts joining at once, those that fit go in whole, first come first, and the oldest longer
one takes the rest (StaticEngine.allot). Within `--chunked-prefill-size`, at least MIN_TOKENS
(short prompts are never split: where even that many tokens take longer than `steps` decode
steps, as on a CPU, rounds that admit a long prompt take longer than the target);
FIRST_TOKENS before any chunk is measured. An idle engine prefills whole, unless its prefills
so far say that takes over IDLE_WHOLE_S: then `--chunked-prefill-size` tokens a round, so a
request that arrives meanwhile waits for one chunk, not the whole prompt. Before any prefill
of MIN_TOKENS or more was timed, a prompt longer than that cap takes one chunk of it first,
timed (on a 2-core CPU an engine that had served only short prompts took a first 8,191-token
prompt whole: ~33 s that three requests arriving 1 s later waited, a probe's finding; on a
GPU the first long prompt pays one forward more, once).
"""

from __future__ import annotations

# the least a round prefills: a prompt this short (most chat turns) goes in whole, only long
# ones are paced (as vLLM's long_prefill_token_threshold); on a GPU the paced size is larger
MIN_TOKENS = 256
FIRST_TOKENS = MIN_TOKENS  # before a chunk was measured
SMOOTHING = 0.5  # weight of the newest decode step in their average
SPIKE = 4.0  # a step counts as at most this many times the average
FORGET = 0.9  # a size class's older chunks weigh this much less with each newer one
# a class not measured in this many chunks is dropped (older contexts, other loads); one that
# takes over OVER x the target is kept 4x as long (trying it again costs such a round)
STALE = 32
OVER = 1.5
SPIKE_CHUNK = 1.2  # a chunk counts as at most this many times what its class predicts
# the next larger size, where it reads at most RETRY x the target and was not measured in
# RETRY_AFTER chunks, is tried again (a slow chunk, or a longer context, put it over)
RETRY = 1.25
RETRY_AFTER = 8
SPREAD = 256  # keys: contexts this far apart (standard deviation) give a class its own slope
# beside the step (--overlap-prefill) a step is timed with a chunk taking the device too, so it
# is no plain step: after this many such rounds in a row, one round leaves its joining prompts
# for the next and its step, alone, refreshes the step time chunks are sized by (and adaptive
# speculation's round times). Without it a run of rounds that all carry a chunk sizes them
# by the last plain step's time, taken at another batch size and context. That round costs
# the prompts one plain step's wait, once in REFRESH + 1 rounds.
REFRESH = 16
# an idle engine prefills the prompts waiting whole (on an H200 a 7,200-token prompt is one
# ~13 ms forward) unless the fastest of its last IDLE_SAMPLES prefills' rates (seconds a prompt
# token, of forwards of MIN_TOKENS or more, the step not beside them) says that takes longer
# than this; then --chunked-prefill-size tokens a round, as vLLM's and SGLang's cap every
# round: on a 2-core CPU (~7 ms a token) an 8,000-token prompt was one ~54 s forward, and a
# request arriving meanwhile waited all of it. The fastest of several: a first-use spike (a
# graph captured, a kernel compiled) does not cap a fast device's prompts.
IDLE_WHOLE_S = 0.5
IDLE_SAMPLES = 8


class _Size:
    """One size class's chunks: their tokens (average) and time as a line over context,
    least squares over recent chunks, each older one weighing FORGET x less."""

    __slots__ = ("n", "w", "sx", "sy", "sxx", "sxy", "when")

    def __init__(self) -> None:
        self.n = self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.when = 0

    def add(self, tokens: int, context: int, seconds: float, when: int) -> None:
        f = FORGET
        self.n = (f * self.w * self.n + tokens) / (f * self.w + 1)
        self.w, self.sx, self.sy = f * self.w + 1, f * self.sx + context, f * self.sy + seconds
        self.sxx = f * self.sxx + context * context
        self.sxy = f * self.sxy + context * seconds
        self.when = when

    def slope(self) -> float | None:
        """Seconds per key of context, where its chunks' contexts spread enough."""
        mx = self.sx / self.w
        var = self.sxx / self.w - mx * mx
        if var < SPREAD * SPREAD:
            return None
        return max(0.0, (self.sxy / self.w - mx * self.sy / self.w) / var)

    def at(self, context: int, per_key_token: float) -> float:
        """Its time at `context` (per_key_token: the slope of classes that have one, per
        token, for a class whose contexts did not spread)."""
        mx, my = self.sx / self.w, self.sy / self.w
        slope = self.slope()
        if slope is None:
            slope = per_key_token * self.n
        return max(my + slope * (context - mx), 1e-9)


class PrefillPacer:
    def __init__(self, max_tokens: int, steps: float):
        self.max_tokens = max_tokens if max_tokens > 0 else None  # -1 / 0: no token cap
        self.steps = steps  # 0: the token cap only
        self.step_s: float | None = None
        self.chunks: dict[int, _Size] = {}  # by size class (tokens' bit length)
        self.count = 0  # chunks measured
        self.slope_s: float | None = None  # seconds a token more, between two sizes measured
        self.context = 0  # the context of the last chunk sized
        # chunks run beside the decode step (--overlap-prefill): the round takes about the
        # chunk's time, not the step's plus it, so a chunk may take 1 + `steps` steps
        self.beside = False
        self.rounds_beside = 0  # rounds in a row whose step ran beside a chunk
        self.token_rates: list[float] = []  # seconds a prompt token, the last IDLE_SAMPLES

    def timed(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` prompt tokens took `seconds` of wall time, nothing beside it
        (idle, or a serial chunk): its rate, for an idle engine's whole-or-chunk choice."""
        if tokens >= MIN_TOKENS and seconds > 0:
            self.token_rates = [*self.token_rates[1 - IDLE_SAMPLES :], seconds / tokens]

    def plain_due(self) -> bool:
        """Whether the next round should step alone (no chunk beside it) to time a plain
        step: none timed yet, or REFRESH rounds in a row ran their step beside a chunk."""
        return self.step_s is None or self.rounds_beside >= REFRESH

    def budget(self, decoding: bool, context: int = 0, waiting: int = 0) -> int | None:
        """Prompt tokens the next round may prefill, its chunk after `context` keys of its
        prompt, `waiting` tokens of prompts to go in all; None = all of them."""
        if not decoding:
            if self.max_tokens is None or waiting <= self.max_tokens:
                return None
            if not self.token_rates:  # the first long prompt: a chunk, timed, tells the rate
                return self.max_tokens
            return None if waiting * min(self.token_rates) <= IDLE_WHOLE_S else self.max_tokens
        self.context = context
        if self.steps <= 0 or self.step_s is None:
            return self.max_tokens
        n = self._size(self._target(), context) if self.chunks else FIRST_TOKENS
        n = max(MIN_TOKENS, n)
        return n if self.max_tokens is None else min(n, self.max_tokens)

    def _target(self) -> float:
        """Seconds a chunk may take: `steps` decode steps (1 more beside the step)."""
        return (self.steps + (1 if self.beside else 0)) * (self.step_s or 0.0)

    def _per_key_token(self) -> float:
        slopes = [(s.slope(), s.n) for s in self.chunks.values()]
        known = [k / n for k, n in slopes if k is not None]
        return sum(known) / len(known) if known else 0.0

    def _size(self, target: float, context: int) -> int:
        """The chunk that takes about `target` seconds at `context`, read off the sizes."""
        pk = self._per_key_token()
        sizes = sorted(((s.n, s.at(context, pk), s) for s in self.chunks.values()), key=_first)
        fit = [(n, t) for n, t, _ in sizes if t <= target]
        if not fit:
            n, t, _ = sizes[0]
            return int(n * target / t)
        n0, t0 = fit[-1]
        over = [(n, t, s) for n, t, s in sizes if n > n0]  # each takes longer than the target
        if over:  # between the two, on the line through them
            n1, t1, s1 = over[0]
            if t1 <= RETRY * target and self.count - s1.when >= RETRY_AFTER:
                return int(n1)  # close to the target and not measured lately: once more
            self.slope_s = (t1 - t0) / (n1 - n0)
            return int(n0 + (target - t0) / self.slope_s)
        if len(fit) > 1 and fit[-2][1] < t0:
            ns, ts = fit[-2]
            self.slope_s = (t0 - ts) / (n0 - ns)
        if self.slope_s is None:
            n = 2 * n0
        else:
            n = min(n0 + (target - t0) / self.slope_s, 4 * n0)
        return int(max(n, n0 * target / t0))  # at least what a cost in proportion fits

    def prefilled(
        self,
        tokens: int,
        seconds: float,
        budget: int | None = None,
        ended: bool = False,
        context: int = 0,
    ) -> None:
        """A chunk prefilled while others decoded: `tokens` after `context` keys of its
        prompt in `seconds` (device work done), of a round whose budget was `budget`, that
        `ended` a prompt or not."""
        if tokens <= 0 or seconds <= 0:
            return
        if budget is not None and (ended or 2 * tokens < budget):
            return
        self.count += 1
        cls = int(tokens).bit_length()
        size = self.chunks.get(cls)
        if size is None:
            size = self.chunks[cls] = _Size()
        else:
            seconds = min(seconds, SPIKE_CHUNK * size.at(context, self._per_key_token()))
        size.add(tokens, context, seconds, self.count)
        target = self._target()
        for c, s in list(self.chunks.items()):
            late = self.count - s.when
            if late > (4 * STALE if s.sy / s.w > OVER * target else STALE):
                del self.chunks[c]

    def stepped(self, seconds: float) -> None:
        """A decode round (draft + verify) of the running requests took `seconds`. A spike
        (a graph captured on first use, a drafter catching up on a newcomer's prompt) counts
        as at most SPIKE times the average: one slow step never lets a whole prompt in."""
        self.rounds_beside = 0
        if seconds > 0:
            if self.step_s is not None:
                seconds = min(seconds, SPIKE * self.step_s)
            self.step_s = _smooth(self.step_s, seconds)

    def stepped_beside(self) -> None:
        """A decode round ran beside a chunk (its time is not a plain step's)."""
        self.rounds_beside += 1


def _first(item: tuple) -> float:
    return item[0]


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
