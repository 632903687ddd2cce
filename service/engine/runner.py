"""The builtin engine's runtime: a worker thread that interleaves requests round by round.

Interface (what the server, tests and benchmarks use):
    EngineRunner.start()                      load weights, warm up, start the worker
    EngineRunner.generate(prompt, sampling)   async iterator of StepOutput; the last one has
                                              finished=True and the request's stats.
                                              Errors raise from the iterator (EngineError);
                                              closing the iterator early cancels the request.
    EngineRunner.submit(request)              the same for an EngineRequest whose `deliver`
                                              says where outputs go (the engine core's
                                              outbox, sent once per iteration by
                                              `on_iteration`: ddserve.engine.core)
    EngineRunner.update_params(**changes)     validate, swap between rounds, return the config
    EngineRunner.check_health()               a real one-token generation
    EngineRunner.shutdown()

Each request holds a slot of the engine's KV pool; the worker runs one DDTree round of every
active request together, so concurrent requests all progress and stream. Live parameters are read
once per round, so a change applies atomically to whole rounds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.adaptive import SpecPolicy, candidates
from ddserve.engine.build import build_engine
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.prefill_pacing import PrefillPacer
from ddserve.engine.round_log import RoundLog
from ddserve.engine.sampling import Logprobs, RequestStats, SamplingParams
from ddserve.engine.sequence import Sequence
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import LoadedModel
from ddserve.errors import EngineError, EngineUnavailable, InvalidRequest

log = logging.getLogger(__name__)

WARM_PROMPT_TOKENS = 24  # the start-up generation's prompt (a short chat's prefill chunk)


@dataclass
class StepOutput:
    token_ids: list[int]  # new tokens of this round
    finished: bool
    finish_reason: str | None
    fingerprint: str
    stats: RequestStats  # the request's statistics so far
    logprobs: Logprobs | None = None  # raw log-probs of token_ids, when the request asks


class EngineRequest:
    """One request as the worker sees it. `deliver` hands a StepOutput or an exception to
    whoever waits for it; subclasses say where (an asyncio queue in this process; the
    engine core's per-round outbox, ddserve.engine.core)."""

    def __init__(self, prompt: list[int], sampling: SamplingParams):
        self.prompt, self.sampling = prompt, sampling
        self.t0 = time.perf_counter()  # received (request phase times: RequestStats)
        self.seq: Sequence | None = None  # made by the worker thread
        self.failed = False
        self.cancelled = False
        self.prefilled = False

    @property
    def finished(self) -> bool:
        return self.failed or (self.seq is not None and self.seq.finished)

    def deliver(self, item: StepOutput | BaseException) -> None:
        raise NotImplementedError


class _AsyncRequest(EngineRequest):
    """A request of `EngineRunner.generate`: outputs go to the caller's event loop."""

    def __init__(self, prompt: list[int], sampling: SamplingParams, loop):
        super().__init__(prompt, sampling)
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone; nobody is waiting
            self.cancelled = True


async def health_generation(outputs: AsyncIterator, timeout: float, t0: float) -> float:
    """Drain a one-token health generation (any iterator of outputs with `token_ids`) within
    `timeout`; returns seconds since `t0` (time.perf_counter), or raises EngineUnavailable /
    EngineError. The one health rule of the in-process runner and the engine core's client."""

    async def count() -> int:
        n = 0
        async for out in outputs:
            n += len(out.token_ids)
        return n

    try:
        n = await asyncio.wait_for(count(), timeout)
    except TimeoutError as exc:
        raise EngineUnavailable(f"health generation did not finish within {timeout:.0f}s") from exc
    if n < 1:
        raise EngineError("health generation returned no token")
    return time.perf_counter() - t0


# "0": decode steps keep the default stream's priority beside overlapped prompt chunks (A/B)
PRIORITY_ENV = "DDSERVE_DECODE_PRIORITY"


class EngineRunner:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None):
        self.config = config
        self._loaded = loaded
        self.engine: StaticEngine | None = None
        self.tokenizer = None
        self.max_context = 0
        self._fingerprint = ""
        self._pending: list[EngineRequest] = []
        self._active: list[EngineRequest] = []
        # called by the worker after every iteration (its rounds done, finished requests
        # released): the engine core sends the iteration's outputs from here, once
        self.on_iteration: Callable[[], None] | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.started_at = 0.0
        self.load_s = 0.0
        self.policy: SpecPolicy | None = None  # adaptive speculation (made at load)
        self.last_budget = 0  # the budget of the last round (a gauge)
        # prompt tokens a round prefills while others decode (chunked prefill, paced by time)
        self.pacer = PrefillPacer(config.chunked_prefill_size, config.chunked_prefill_steps)
        self.round_log = RoundLog(config.decode_log_interval)  # the scheduler's log line
        self.overlap = False  # prompt chunks beside decode steps (--overlap-prefill, at load)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Load, warm up and serve, all torch work in the worker thread: on CPU, torch's
        parallel regions run 2-5x slower from a thread once another thread has run some
        (seen with libgomp, cause not pinned down; on this 2-core VM: a DDTree round 44 ms
        in the only torch thread, 75 ms in a second one). Returns once the engine is ready;
        load errors are raised here."""
        t0 = time.perf_counter()
        ready, failed = threading.Event(), []

        def worker() -> None:
            try:
                threads = os.environ.get("DDSERVE_THREADS")
                if threads:
                    torch.set_num_threads(int(threads))
                self._load()
            except BaseException as exc:
                failed.append(exc)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=worker, name="ddtree-worker", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        self.load_s = time.perf_counter() - t0
        self.started_at = time.time()
        log.info(
            "engine ready in %.1fs: model=%s drafter=%s fingerprint=%s",
            self.load_s,
            self.config.model,
            self.engine.drafter.name,
            self._fingerprint,
        )

    def _load(self) -> None:
        self.engine, self.tokenizer, self.max_context = build_engine(self.config, self._loaded)
        drafter = self.engine.drafter
        model = self.engine.model
        params = self.config.params
        choice = self.config.overlap_prefill
        self.overlap = choice == "on" or (choice == "auto" and model.device.type == "cuda")
        self.pacer.beside = self.overlap and model.device.type == "cuda"
        if self.config.speculative_adaptive and not isinstance(drafter, NoDrafter):
            self.policy = SpecPolicy()
        budgets = candidates(params.budget) if self.policy else None
        spent = self.engine.warm_up(params, budgets=budgets)  # part of readiness
        if spent:
            log.info("warm-up: %d CUDA graphs captured in %.1fs", self.engine.graph_count, spent)
        if self.policy is not None:  # its start-up cost model: every candidate at every batch
            t0 = time.perf_counter()
            times = self.engine.round_times(params, budgets)  # a failure ends it, not the start
            for (batch, budget), seconds in times.items():
                self.policy.prior(batch, budget, seconds)
            log.info(
                "adaptive speculation: %d round times measured in %.1fs",
                len(times),
                time.perf_counter() - t0,
            )
        self._fingerprint = self.config.fingerprint()
        # a real generation before ready, through prefill and a few rounds: on a CPU the first
        # use of each kernel shape costs ~0.5 s (no graphs there to capture), paid here rather
        # than by the first request
        n = max(1, min(WARM_PROMPT_TOKENS, self.max_context - 5))
        warm = [model.cfg.bos_token_id or 0] * n
        # with the live sampling defaults: a sampled default is proven (and warmed) too
        sampling = SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=2,
            seed=0,
        )
        self.engine.generate(warm, sampling, params)

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for req in self._pending + self._active:
            req.deliver(EngineUnavailable("engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def load(self) -> dict:
        return {"running": len(self._active), "waiting": len(self._pending)}

    def load_gauges(self) -> dict:
        """The engine's load in the metric names of ddserve.api.observability.LOAD_GAUGES."""
        total = self.engine.pool.slots if self.engine is not None else self.config.max_batch
        free = self.engine.free_slots if self.engine is not None else total
        return {
            "num_requests_running": len(self._active),
            "num_requests_waiting": len(self._pending),
            "kv_slots_used": total - free,
            "kv_slots_total": total,
            "spec_budget": self.last_budget,
            "prefill_chunk_tokens": self.pacer.budget(True, self.pacer.context) or 0,
        }

    # -- live parameters --------------------------------------------------------------
    def update_params(self, **changes) -> EngineConfig:
        """Validate and swap live parameters; in force for every round that starts after
        this returns. Invalid values raise ConfigError and change nothing."""
        new = self.config.with_params(**changes)
        with self._cv:  # the worker reads config under the lock at each round start
            self.config = new
            self._fingerprint = new.fingerprint()
        log.info("live params now %s (%s)", new.params.model_dump(), self._fingerprint)
        return new

    # -- requests ---------------------------------------------------------------------
    async def generate(
        self, prompt: list[int], sampling: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        req = _AsyncRequest(prompt, sampling, asyncio.get_running_loop())
        self.submit(req)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            req.cancelled = True

    def check_prompt(self, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        vocab = self.engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="input_ids")
        if sampling is not None:
            bad = [t for t, _ in sampling.logit_bias if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(
                    f"logit_bias: token id {bad[0]} is not in this model's vocabulary [0, {vocab})",
                    param="logit_bias",
                )

    def submit(self, req: EngineRequest) -> None:
        """Queue a request for the worker (which makes its sequence: its KV slot is a torch
        allocation, so torch stays in the worker thread). Cancel it with `req.cancelled`."""
        if not self.alive:
            raise EngineUnavailable("engine is not running")
        self.check_prompt(req.prompt, req.sampling)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()

    def wake(self) -> None:
        """Make an idle worker look again (a request was cancelled from outside)."""
        with self._cv:
            self._cv.notify()

    async def check_health(self, timeout: float = 60.0) -> float:
        """A real generation of one token with the live sampling defaults (so a default that
        breaks sampling fails here); returns its latency in seconds."""
        t0 = time.perf_counter()
        prompt = [self.engine.model.cfg.bos_token_id or 0] if self.engine else [0]
        p = self.config.params
        sampling = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=1, ignore_eos=True
        )

        return await health_generation(self.generate(prompt, sampling), timeout, t0)

    # -- worker -----------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        device = self.engine.model.device
        if self.overlap and device.type == "cuda" and os.environ.get(PRIORITY_ENV) != "0":
            # decode steps on a stream of high priority: beside a prompt chunk (the default
            # stream's priority, the lowest), their kernels are scheduled first
            torch.cuda.set_stream(torch.cuda.Stream(device, priority=-1))
        while True:
            with self._cv:
                while not self._stopping and not self._pending and not self._active:
                    self._cv.wait()
                if self._stopping:
                    return
                room = self._room()
                self._active.extend(self._pending[:room])
                del self._pending[:room]
                active = list(self._active)
            size = self.config.max_batch
            for start in range(0, len(active), size):
                with self._cv:
                    params, fingerprint = self.config.params, self._fingerprint
                self._run_round(active[start : start + size], params, fingerprint)
            with self._cv:
                done = [r for r in self._active if r.cancelled or r.finished]
                self._active = [r for r in self._active if not (r.cancelled or r.finished)]
            for req in done:
                if req.seq is not None:
                    self.engine.release(req.seq)
            if self.on_iteration is not None:
                self.on_iteration()

    def _room(self) -> int:
        """Pending requests that may start now: as many as the KV pool has free slots for
        (counting active ones that take theirs in their first round: no sequence yet)."""
        free = self.engine.free_slots
        unprefilled = sum(1 for r in self._active if r.seq is None and not r.failed)
        return max(0, free - unprefilled)

    def _run_round(self, reqs: list[EngineRequest], params: LiveParams, fingerprint: str) -> None:
        """One round of every request in `reqs`, their trees verified in one forward. New
        requests are prefilled first (continuous batching: join and leave between rounds)."""
        ready, joining = [], []
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
        if joining:  # the new requests' prompts in one batch; one by one if that fails
            # while others decode, a bounded chunk per round (chunked prefill); alone, all of it
            # the chunk's context: the keys the oldest prompt under way has in (first come)
            context = max(r.seq.cache.length for r in joining)
            budget = self.pacer.budget(decoding=bool(ready), context=context)
            t0 = time.perf_counter()
            paced = bool(ready) and budget is not None
            # beside the running requests' step (its own stream), which then comes first
            overlap = self.overlap and bool(ready)
            try:
                seqs = [r.seq for r in joining]
                spent = self.engine.prefill_batch(seqs, budget, overlap=overlap)
                chunk = [spent, time.perf_counter() - t0]
            except Exception:
                self.engine.join_prefill()  # what was launched has run: its slots start over
                paced, spent, overlap = False, 0, False
                for req in joining:
                    req.seq.hidden_new.clear()  # start each prompt over on its own
                    req.seq.cache.truncate(0)
                    try:
                        spent += self.engine.prefill_batch([req.seq], budget)
                    except Exception as exc:
                        self._fail(req, exc)
                chunk = [spent, time.perf_counter() - t0]
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
            self._prefill_done(chunk, pacing)
            self._log_round(chunk, 0.0, 0)
            return
        live, limit = params, self.config.spec_max_batch
        budget, rows = params.budget, self._rows(len(ready))
        if limit is not None and len(ready) > limit:
            budget = 0  # batch-bound: verify roots only
        elif self.policy is not None:
            budget = self._adapt("choose", rows, budget, default=budget)
        if budget != params.budget:
            params = params.model_copy(update={"budget": budget})
        self.last_budget = budget
        t0 = time.perf_counter()
        try:
            news = self.engine.step_batch([r.seq for r in ready], params)
            step_s = time.perf_counter() - t0
        except Exception:
            self._prefill_done(chunk, pacing)
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
        if not self._prefill_done(chunk, pacing):  # a step beside a chunk is no plain step
            self.pacer.stepped(step_s)
        made = sum(len(n) for n in news if isinstance(n, list))
        self._log_round(chunk, step_s, made, len(ready))
        if self.policy is not None:
            done = zip(ready, news, strict=True)
            paths = [r.seq.last_path for r, n in done if not isinstance(n, Exception)]
            self._adapt("record", rows, budget, time.perf_counter() - t0, paths)
        # past the shared forward each request's outcome is its own: a failure ends that
        # request only, every other one gets this round's tokens (exactly once)
        for req, new in zip(ready, news, strict=True):
            if isinstance(new, Exception):
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

    def _prefill_done(self, chunk: list, pacing: tuple | None) -> bool:
        """After the round's step: wait for a chunk that ran beside it (its GPU time replaces
        its launch time) and tell the pacer of the chunk. Whether one ran beside the step."""
        seconds = self.engine.join_prefill()
        if seconds is not None:
            chunk[1] = seconds
        if pacing is not None:
            self.pacer.prefilled(chunk[0], chunk[1], *pacing)
        return seconds is not None

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
