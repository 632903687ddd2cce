"""Chunked prefill paced by time (the runner's admission of long prompts, issue 18).

While requests decode, every round that also prefills a newcomer's prompt makes them wait for
that prefill: a 2,048-token chunk at ~5k keys cost ~10 ms next to a ~2 ms decode step on the
H200, so the running streams saw an 8x gap. A fixed token cap (`--chunked-prefill-size`, as
SGLang's) cannot fit every model, GPU and context length; here the chunk is sized from this
engine's own measured rounds instead:

    tokens = steps x (decode step time) / (prefill time per token)

both as moving averages of recent rounds (prefill measured on chunks taken while others
decoded, so at the sizes in use: a smaller chunk costs more per token, which steers the next
one back up: the size settles where a chunk takes `steps` decode steps; only chunks that
filled their budget count, a prompt's padded tail would read as slow). A round that prefills
then takes about 1 + `steps` decode steps; of several prompts joining at once, those that fit
go in whole, first come first, and the oldest longer one takes the rest (StaticEngine.allot).
Within `--chunked-prefill-size`, at least MIN_TOKENS (short prompts are never split: where
even that many tokens take longer than `steps` decode steps, as on a CPU, rounds that admit
a long prompt take longer than the target); FIRST_TOKENS before any chunk is measured. An
idle engine prefills whole.
"""

from __future__ import annotations

# the least a round prefills: a prompt this short (most chat turns) goes in whole, only long
# ones are paced (as vLLM's long_prefill_token_threshold); on a GPU the paced size is larger
MIN_TOKENS = 256
FIRST_TOKENS = MIN_TOKENS  # before a chunk was measured
SMOOTHING = 0.5  # weight of the newest measurement (contexts grow over a long prompt)
SPIKE = 4.0  # a step counts as at most this many times the average


class PrefillPacer:
    def __init__(self, max_tokens: int, steps: float):
        self.max_tokens = max_tokens if max_tokens > 0 else None  # -1 / 0: no token cap
        self.steps = steps  # 0: the token cap only
        self.step_s: float | None = None
        self.token_s: float | None = None

    def budget(self, decoding: bool) -> int | None:
        """Prompt tokens the next round may prefill; None = all of them."""
        if not decoding:
            return None
        if self.steps <= 0 or self.step_s is None:
            return self.max_tokens
        if self.token_s is None:
            n = FIRST_TOKENS
        else:
            n = max(MIN_TOKENS, int(self.steps * self.step_s / self.token_s))
        return n if self.max_tokens is None else min(n, self.max_tokens)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk prefilled while others decoded: `tokens` in `seconds` (device work done)."""
        if tokens > 0 and seconds > 0:
            self.token_s = _smooth(self.token_s, seconds / tokens)

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
