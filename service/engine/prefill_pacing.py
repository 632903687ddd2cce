"""Chunked prefill paced by time (the runner's admission of long prompts, issue 18).

While requests decode, every round that also prefills a newcomer's prompt makes them wait for
that prefill: a 2,048-token chunk at ~5k keys cost ~10 ms next to a ~2 ms decode step on the
H200, so the running streams saw an 8x gap. A fixed token cap (`--chunked-prefill-size`, as
SGLang's) cannot fit every model, GPU and context length; here the chunk is sized from this
engine's own measured rounds instead, to take about `steps` decode steps (the target):

  * chunks taken while others decoded are measured by size class (a power of two of tokens:
    their tokens and seconds as moving averages; a class not measured lately is dropped);
  * the next chunk's size is read off the measured sizes that bracket the target: between the
    largest that took at most the target and the next larger one that took more, on the line
    through the two; where nothing larger was measured, twice the largest that fitted (a
    chunk's time grows at most in proportion to its size, so that one round takes at most 2x
    the target, and then the bracket is known); where nothing fitted, the smallest measured
    size scaled down to the target.

No cost model is assumed: under CUDA graphs a chunk forward costs ~1.2 ms whatever its width
on the H200, ~3.3 us a token more at ~3k keys; a burst of short prompts is one forward per 8;
a chunk's cost grows with its context. Sizing by time per token alone (the thirteenth
session's pacer) read a 256-token chunk's ~2 ms as 7.8 us a token and asked for ~384 tokens,
which the engine, taking the widest chunk width within a budget, took as 256 again: 16
prompts of ~2,900 tokens went in 256 tokens a round, every round prefilled, and their
throughput was 0.32x of short prompts'; a 512-token chunk (~2.9 ms) fitted 1.5 steps. Only
chunks that filled most of their budget count (a prompt's padded tail would read as slow).

A round that prefills then takes about 1 + `steps` decode steps; of several prompts joining at
once, those that fit go in whole, first come first, and the oldest longer one takes the rest
(StaticEngine.allot). Within `--chunked-prefill-size`, at least MIN_TOKENS (short prompts are
never split: where even that many tokens take longer than `steps` decode steps, as on a CPU,
rounds that admit a long prompt take longer than the target); FIRST_TOKENS before any chunk is
measured. An idle engine prefills whole.
"""

from __future__ import annotations

# the least a round prefills: a prompt this short (most chat turns) goes in whole, only long
# ones are paced (as vLLM's long_prefill_token_threshold); on a GPU the paced size is larger
MIN_TOKENS = 256
FIRST_TOKENS = MIN_TOKENS  # before a chunk was measured
SMOOTHING = 0.5  # weight of the newest measurement (contexts grow over a long prompt)
SPIKE = 4.0  # a step counts as at most this many times the average
# a size not measured in this many chunks is dropped; one that took longer than the target is
# kept 4x as long (a probe past it costs a round of up to 2x the target)
STALE = 32


class PrefillPacer:
    def __init__(self, max_tokens: int, steps: float):
        self.max_tokens = max_tokens if max_tokens > 0 else None  # -1 / 0: no token cap
        self.steps = steps  # 0: the token cap only
        self.step_s: float | None = None
        # chunks measured, by size class (tokens' bit length): [tokens, seconds, when]
        self.chunks: dict[int, list[float]] = {}
        self.count = 0  # chunks measured

    def budget(self, decoding: bool) -> int | None:
        """Prompt tokens the next round may prefill; None = all of them."""
        if not decoding:
            return None
        if self.steps <= 0 or self.step_s is None:
            return self.max_tokens
        n = self._size(self.steps * self.step_s) if self.chunks else FIRST_TOKENS
        n = max(MIN_TOKENS, n)
        return n if self.max_tokens is None else min(n, self.max_tokens)

    def _size(self, target: float) -> int:
        """The chunk that takes about `target` seconds, read off the measured sizes."""
        sizes = sorted(p[:2] for p in self.chunks.values())
        fit = [(n, t) for n, t in sizes if t <= target]
        if not fit:
            n, t = sizes[0]
            return int(n * target / t)
        n0, t0 = fit[-1]
        over = [(n, t) for n, t in sizes if n > n0]  # each took longer than the target
        if not over:  # twice the size, or more where even a cost in proportion fits
            return int(max(2 * n0, n0 * target / t0))
        n1, t1 = over[0]
        return int(n0 + (target - t0) * (n1 - n0) / (t1 - t0))

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk prefilled while others decoded: `tokens` in `seconds` (device work done)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.count += 1
        cls = int(tokens).bit_length()
        old = self.chunks.get(cls)
        if old is None:
            self.chunks[cls] = [float(tokens), seconds, self.count]
        else:
            old[:] = [_smooth(old[0], tokens), _smooth(old[1], seconds), self.count]
        # sizes not measured lately (older contexts, other loads) no longer count
        target = self.steps * (self.step_s or 0.0)
        for c, (_, t, when) in list(self.chunks.items()):
            if self.count - when > (4 * STALE if t > target else STALE):
                del self.chunks[c]

    def stepped(self, seconds: float) -> None:
        """A decode round (draft + verify) of the running requests took `seconds`. A spike
        (a graph captured on first use, a drafter catching up on a newcomer's prompt) counts
        as at most SPIKE times the average: one slow step never lets a whole prompt in."""
        if seconds > 0:
            if self.step_s is not None:
                seconds = min(seconds, SPIKE * self.step_s)
            self.step_s = _smooth(self.step_s, seconds)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
