"""The scheduler's log: one line every `--decode-log-interval` rounds (SGLang's flag and its
"Decode batch." line), saying what those rounds did and where their time went:

    Decode batch. #running-req: 16, #queue-req: 3, gen throughput (token/s): 2712.40,
    rounds: 40: 9 decode 1.71 ms, 31 prefill 2.41 ms (9920 prompt tokens) + decode 1.69 ms

(the mean time of each part: rounds that only decode; rounds that prefill a chunk of joining
prompts, then decode the running requests, the decode's mean over those that had any to
decode; #running-req: the requests of the last round's step; throughput: tokens over the wall time from the
interval's first round to its last, idle time between them included).

A round is one call of the runner's `_run_round`: the prompt chunks of joining requests (if
any), then one decode/verify step of the running ones. The times are the runner's wall clock
around each part (a prefill on a GPU ends with a synchronize; a step returns its tokens, so
both are work done). Cheap: a few additions per round, a line per interval.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("ddserve.engine.scheduler")


class RoundLog:
    def __init__(self, interval: int):
        self.interval = interval  # 0: no log
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.t0 = now
        self.rounds = self.prefilling = 0
        self.tokens = self.prompt_tokens = 0
        self.decode_s = self.chunk_s = self.step_with_chunk_s = 0.0
        self.steps_with_chunk = 0  # prefilling rounds that also ran a step

    def record(
        self,
        prompt_tokens: int,
        chunk_s: float,
        step_s: float,
        new_tokens: int,
        running: int,
        queued: int,
    ) -> str | None:
        """One round: `prompt_tokens` prefilled in `chunk_s` (0, 0: none), then a step of
        `step_s` (0: none ran) that made `new_tokens`. Returns the line when one is due."""
        if self.interval <= 0 or not (prompt_tokens or chunk_s or step_s):
            return None  # no log, or a round that did nothing (every request gone)
        if not self.rounds:  # an interval's clock starts with its first round (not at idle)
            self.t0 = time.perf_counter() - chunk_s - step_s
        self.rounds += 1
        self.tokens += new_tokens
        if prompt_tokens or chunk_s:
            self.prefilling += 1
            self.prompt_tokens += prompt_tokens
            self.chunk_s += chunk_s
            self.step_with_chunk_s += step_s
            self.steps_with_chunk += step_s > 0
        else:
            self.decode_s += step_s
        if self.rounds < self.interval:
            return None
        now = time.perf_counter()
        line = self.line(now - self.t0, running, queued)
        self._reset(now)
        log.info("%s", line)
        return line

    def line(self, wall_s: float, running: int, queued: int) -> str:
        plain = self.rounds - self.prefilling
        text = (
            f"Decode batch. #running-req: {running}, #queue-req: {queued}, "
            f"gen throughput (token/s): {self.tokens / wall_s if wall_s > 0 else 0.0:.2f}, "
            f"rounds: {self.rounds}: {plain} decode {_ms(self.decode_s, plain):.2f} ms"
        )
        if self.prefilling:
            n = self.prefilling
            text += (
                f", {n} prefill {_ms(self.chunk_s, n):.2f} ms ({self.prompt_tokens} prompt "
                f"tokens) + decode {_ms(self.step_with_chunk_s, self.steps_with_chunk):.2f} ms"
            )
        return text


def _ms(seconds: float, n: int) -> float:
    return 1e3 * seconds / n if n else 0.0
