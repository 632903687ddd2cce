"""One round of the builtin engine's worker (EngineRunner's mixin): the joining prompts' chunk
(paced: ddserve.engine.prefill_pacing; on CUDA beside the running requests' step, on a stream
of its own), then one draft + verify step of every request whose prompt is in, then each
request's outcome delivered on its own: a failure inside the shared step retries its requests
one by one, a failure past it ends that request only, and every other request gets the
round's tokens exactly once."""

from __future__ import annotations

import logging
import sys
import time

from ddserve.config.engine import LiveParams
from ddserve.engine.requests import EngineRequest, StepOutput
from ddserve.engine.sequence import tokens_before
from ddserve.errors import EngineError

log = logging.getLogger(__name__)

# an experiment, off (benchmarks' switch: `bench.tuned` {"engine": {"JOIN_BESIDE_TRIP":
# true}}): joining prompts count as newcomers under --first-token-share, so a trip of several
# steps keeps them while few prompts join (their chunk beside the trip's rounds on CUDA,
# before them elsewhere) instead of taking one step for every join. It lost on an H100
# (bench/NOTES.md, thirtieth session): more rounds a trip, but at 64 requests 0.79x the
# throughput and 8x the first token's wait of the default
JOIN_BESIDE_TRIP = False


class Rounds:
    """EngineRunner's rounds (a mixin: it reads the runner's engine, pacer, adaptive policy,
    config, round log and queue)."""

    def _run_round(self, reqs: list[EngineRequest], params: LiveParams, fingerprint: str) -> None:
        """One round of every request in `reqs`, their trees verified in one forward. New
        requests are prefilled first (continuous batching: join and leave between rounds)."""
        ready, joining, overlap = [], [], False
        chunk = [0, 0.0]  # prompt tokens prefilled this round, in seconds (the scheduler log)
        pacing = None  # what the pacer is told of this round's chunk, once it has run
        for req in reqs:
            if req.cancelled or req.failed:
                continue
            if req.prefilled:
                ready.append(req)
                continue
            if req.seq is None:
                try:
                    req.seq = self.engine.new_sequence(req.prompt, req.sampling)
                except Exception as exc:
                    self._fail(req, exc)
                    continue
            joining.append(req)
        # one step this round (num_scheduler_steps) while a prompt waits to join
        steps = self._steps(joining, ready)
        if joining and ready and self.overlap and self.pacer.plain_due():
            joining = []  # this round's step runs alone, timed (PrefillPacer.REFRESH)
        if joining:  # the new requests' prompts in one batch; one by one if that fails
            # while others decode, a bounded chunk per round (chunked prefill); alone, all of it
            # the chunk's context: the keys the oldest prompt under way has in (first come)
            context = max(r.seq.cache.length for r in joining)
            waiting = sum(self.engine.prompt_left(r.seq) for r in joining)
            budget = self.pacer.budget(decoding=bool(ready), context=context, waiting=waiting)
            t0 = time.perf_counter()
            paced = bool(ready) and budget is not None
            # beside the running requests' step (its own stream), which then comes first
            overlap = self.overlap and bool(ready)
            try:
                seqs = [r.seq for r in joining]
                spent = self.engine.prefill_batch(seqs, budget, overlap=overlap)
                chunk = [spent, time.perf_counter() - t0]
            except Exception:  # (an overlapped one has waited for what it launched)
                paced, spent, overlap = False, 0, False
                for req in joining:
                    req.seq.hidden_new.clear()  # start each prompt over on its own
                    req.seq.cache.truncate(0)
                    try:
                        spent += self.engine.prefill_batch([req.seq], budget)
                    except Exception as exc:
                        self._fail(req, exc)
                chunk = [spent, time.perf_counter() - t0]
            if not overlap:  # wall time of work alone: whole-or-chunk when idle
                self.pacer.timed(*chunk)
            if paced:  # the pacer counts chunks that ended no prompt (a padded tail)
                ended = any(not r.failed and self.engine.prefilled(r.seq) for r in joining)
                pacing = (budget, ended, context)
            for req in joining:
                st = req.seq.stats
                # queued until its prompt's first tokens went in (first come first served
                # keeps younger long prompts waiting with their sequences made)
                if not st.queue_s and (req.seq.cache.length or self.engine.prefilled(req.seq)):
                    st.queue_s = max(t0 - req.t0, 1e-9)
                if not req.failed and self.engine.prefilled(req.seq):
                    req.prefilled = True
                    if not overlap:  # else stepped from the next round, its chunk run by then
                        ready.append(req)
        if not ready:
            self._prefill_done(chunk, pacing, joining)
            self._log_round(chunk, 0.0, 0)
            return
        live, limit = params, self.config.spec_max_batch
        budget, rows = params.budget, self._rows(len(ready))
        if limit is not None and len(ready) > limit:
            budget = 0  # batch-bound: verify roots only
        elif self.policy is not None:
            full = steps >= self.config.num_scheduler_steps
            budget = self._adapt("choose", rows, budget, full, default=budget)
        if budget != params.budget:
            params = params.model_copy(update={"budget": budget})
        self.last_budget = budget
        t0 = time.perf_counter()
        try:
            news = self.engine.step_batch([r.seq for r in ready], params, steps)
            step_s = time.perf_counter() - t0
        except Exception:
            self._prefill_done(chunk, pacing, joining)
            if self.policy is not None:
                self._adapt("failed", rows, budget)
            if len(ready) == 1:
                self._fail(ready[0], sys.exc_info()[1])
                return
            # the shared part failed (drafts or verify), before any commit: run them one by
            # one so only the failing one ends (each with the live parameters again)
            log.warning("batched round failed; retrying its %d requests one by one", len(ready))
            for req in ready:
                self._run_round([req], live, fingerprint)
            return
        self._prefill_done(chunk, pacing, joining)
        if overlap:  # a step beside a chunk is no plain step: neither model counts it
            self.pacer.stepped_beside()
        else:
            self.pacer.stepped(step_s / self.engine.round_steps)  # one step's time
        made = sum(len(n) for n in news if isinstance(n, list))
        self._log_round(chunk, step_s, made, len(ready))
        if self.policy is not None and not overlap:
            done = zip(ready, news, strict=True)
            # every round's paths (several back to back on the device: static_spec), and a
            # round's time (their mean)
            paths = [p for r, n in done if not isinstance(n, Exception) for p in r.seq.last_paths]
            # a call's time over the rounds it ran (the policy times from full calls alone)
            ran = self.engine.round_steps
            self._adapt("record", rows, budget, step_s / ran, paths, ran)
        # past the shared forward each request's outcome is its own: a failure ends that
        # request only (after the tokens its call's earlier rounds made), every other one
        # gets this round's tokens (exactly once)
        for req, new in zip(ready, news, strict=True):
            if isinstance(new, Exception):
                if before := tokens_before(new):  # not finished: the error follows
                    stats = req.seq.stats
                    stats.first_token_s = stats.first_token_s or time.perf_counter() - req.t0
                    req.deliver(StepOutput(before, False, None, fingerprint, stats))
                self._fail(req, new)
                continue
            seq, st, since = req.seq, req.seq.stats, time.perf_counter() - req.t0
            if new and not st.first_token_s:
                st.first_token_s = since
            if seq.finished:
                st.finish_s = since
                st.first_token_s = st.first_token_s or since  # none came out
            lp = None if seq.logprobs is None else seq.logprobs.slice(len(seq.logprobs) - len(new))
            req.deliver(
                StepOutput(new, seq.finished, seq.finish_reason, fingerprint, seq.stats, lp)
            )

    def _steps(self, joining: list[EngineRequest], ready: list[EngineRequest]) -> int:
        """Decoding steps (or DDTree rounds) this call takes (--num-scheduler-steps): one
        while a prompt waits to join (chunks go in between rounds), a request that may
        start waits for a slot's round, or requests yet to see their first token are more
        than --first-token-share of the round's (by default any: it comes after one step,
        not N)."""
        n = self.config.num_scheduler_steps
        if n == 1 or (joining and not JOIN_BESIDE_TRIP) or (self._pending and self._room() > 0):
            return 1
        newcomers = len(joining) + sum(1 for r in ready if not r.seq.output)
        share = self.config.first_token_share
        return 1 if newcomers and newcomers > share * (len(ready) + len(joining)) else n

    def _prefill_done(self, chunk: list, pacing: tuple | None, joining: list) -> None:
        """After the round's step: wait for a chunk that ran beside it (its GPU time replaces
        its launch time) and tell the pacer of the chunk. A chunk that failed on the device
        ends the requests it was for (an error, never a stalled worker)."""
        try:
            seconds = self.engine.join_prefill()
        except Exception as exc:  # noqa: BLE001 - a device error, surfaced at the wait
            for req in joining:
                if not req.failed:
                    self._fail(req, exc)
            return
        if seconds is not None:
            chunk[1] = seconds
        if pacing is not None:
            self.pacer.prefilled(chunk[0], chunk[1], *pacing)

    def _log_round(self, chunk: list, step_s: float, new_tokens: int, running: int = 0) -> None:
        self.round_log.record(chunk[0], chunk[1], step_s, new_tokens, running, len(self._pending))

    def _rows(self, ready: int) -> int:
        """The rows a round of `ready` requests verifies: the static engine's forward covers
        slots 0..used_rows-1 (its graphs' batch size), which the adaptive policy keys by."""
        pool = getattr(self.engine, "pool", None)
        return max(ready, pool.used_rows) if pool is not None else ready

    def _adapt(self, verb: str, *args, default=None):
        """A call of the adaptive policy that can never take the round down with it: on an
        error, log it, stop adapting (rounds use the live budget) and go on."""
        try:
            return getattr(self.policy, verb)(*args)
        except Exception:  # noqa: BLE001 - plain arithmetic, but never worth a request
            log.exception("adaptive speculation failed; using the live budget from now on")
            self.policy = None
            return default

    @staticmethod
    def _fail(req: EngineRequest, exc: BaseException) -> None:
        """Torch errors and EngineError alike end this request only."""
        log.error("request failed in the engine: %s", exc, exc_info=exc)
        err = exc if isinstance(exc, EngineError) else EngineError(f"engine failure: {exc}")
        if req.seq is not None:
            req.seq.finish_reason = "error"
        req.failed = True
        req.deliver(err)
