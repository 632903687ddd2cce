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
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from ddserve.config.engine import EngineConfig
from ddserve.engine.adaptive import SpecPolicy, candidates
from ddserve.engine.build import build_engine
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.prefill_pacing import PrefillPacer
from ddserve.engine.requests import AsyncRequest, EngineRequest, StepOutput, health_generation
from ddserve.engine.round_log import RoundLog
from ddserve.engine.rounds import Rounds
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import LoadedModel
from ddserve.errors import EngineUnavailable, InvalidRequest

log = logging.getLogger(__name__)

WARM_PROMPT_TOKENS = 24  # the start-up generation's prompt (a short chat's prefill chunk)


# "0": decode steps keep the default stream's priority beside overlapped prompt chunks (A/B)
PRIORITY_ENV = "DDSERVE_DECODE_PRIORITY"


class EngineRunner(Rounds):
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
        """The engine's load in the metric names of ddserve.api.prometheus.LOAD_GAUGES."""
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
        req = AsyncRequest(prompt, sampling, asyncio.get_running_loop())
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
            torch.cuda.synchronize()  # the warm-up's last work, queued on the default stream
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
