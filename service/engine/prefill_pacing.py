"""Chunked prefill paced by time (the runner's admission of long prompts, issue 18).

While requests decode, every round that also prefills a newcomer's prompt makes them wait for
that prefill: a 2,048-token chunk at ~5k keys cost ~10 ms next to a ~2 ms decode step on the
H200, so the running streams saw an 8x gap. A fixed token cap (`--chunked-prefill-size`, as
SGLang's) cannot fit every model, GPU and context length; here the chunk is sized from this
engine's own measured rounds instead, so that it takes `steps` decode steps:

    chunk time = fixed + per_token x tokens        tokens = (steps x step - fixed) / per_token

both terms from chunks taken while others decoded (moving averages of recent rounds): the
fixed part from two chunks of different sizes (the line through them), the per-token part
from the newest chunk (contexts grow over a long prompt, and so does its cost). Only chunks
that filled most of their budget count (a prompt's padded tail would read as slow).

The fixed part matters: under CUDA graphs a chunk forward costs ~1.2 ms whatever its width on
the H200 (weights read, launches), ~3.3 us a token more at ~3k keys. Sizing by the cost per
token alone (time / tokens, no fixed part) under-estimates what fits, and with the engine's
chunk widths (a budget of 394 tokens takes a 256-token chunk) it settled at 256 tokens a round:
16 prompts of ~2,900 tokens then needed 11 rounds each, every round prefilled, and their
throughput was 0.32x of short prompts' (thirteenth session). Until two sizes are measured, a
chunk that took less than the target is followed by one twice as large (at most 2x the target,
once), which gives the line its second point.

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
STALE = 32  # a size not measured in this many chunks is dropped
MIN_SHARE = 0.1  # the per-token part is at least this share of a chunk's time


class PrefillPacer:
    def __init__(self, max_tokens: int, steps: float):
        self.max_tokens = max_tokens if max_tokens > 0 else None  # -1 / 0: no token cap
        self.steps = steps  # 0: the token cap only
        self.step_s: float | None = None
        self.fixed_s: float | None = None  # a chunk forward's cost whatever its size
        # chunks measured, by size class (tokens' bit length): [tokens, seconds, when]
        self.chunks: dict[int, list[float]] = {}
        self.last: int | None = None  # the newest measurement's class
        self.count = 0

    @property
    def token_s(self) -> float | None:
        """The newest chunks' cost per token past the fixed part (None: none measured)."""
        if self.last is None:
            return None
        n, t, _ = self.chunks[self.last]
        return max(t - (self.fixed_s or 0.0), MIN_SHARE * t) / n

    def budget(self, decoding: bool) -> int | None:
        """Prompt tokens the next round may prefill; None = all of them."""
        if not decoding:
            return None
        if self.steps <= 0 or self.step_s is None:
            return self.max_tokens
        if self.last is None:
            n = FIRST_TOKENS
        else:
            target = self.steps * self.step_s
            tokens, seconds, _ = self.chunks[self.last]
            n = int(max(0.0, target - (self.fixed_s or 0.0)) / self.token_s)
            if self.fixed_s is None and len(self.chunks) == 1 and seconds < target:
                n = max(n, 2 * int(tokens))  # no line yet: a chunk twice as large (<= 2x target)
            n = max(MIN_TOKENS, n)
        return n if self.max_tokens is None else min(n, self.max_tokens)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk prefilled while others decoded: `tokens` in `seconds` (device work done)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.count += 1
        cls = int(tokens).bit_length()
        # sizes not measured lately (older contexts, other loads) no longer count
        for c in [c for c, p in self.chunks.items() if self.count - p[2] > STALE]:
            del self.chunks[c]
        old = self.chunks.get(cls)
        if old is None:
            self.chunks[cls] = [float(tokens), seconds, self.count]
        else:
            old[:] = [_smooth(old[0], tokens), _smooth(old[1], seconds), self.count]
        # the line through this chunk and the newest one of another size: its intercept is the
        # fixed part (a slope of 0 or less, noise or a grown context, says nothing of it)
        if self.last is not None and self.last != cls and self.last in self.chunks:
            (n0, t0, _), (n1, t1, _) = self.chunks[self.last], self.chunks[cls]
            slope = (t1 - t0) / (n1 - n0)
            if slope > 0:
                fixed = min(max(0.0, t1 - slope * n1), (1 - MIN_SHARE) * min(t0, t1))
                self.fixed_s = _smooth(self.fixed_s, fixed)
        self.last = cls
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
