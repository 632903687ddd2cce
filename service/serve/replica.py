"""The replica deployment: each replica owns one engine process and serves the OpenAI API.

    build_app(config)  ->  a Serve application of `EngineReplica` (FastAPI ingress)

A replica starts its engine (builtin or SGLang) as a child process on a free loopback port,
waits until a real generation passes, then serves `create_app(RemoteBackend)`. GPU engines
reserve `tp_size` GPUs in a placement group; Ray sets CUDA_VISIBLE_DEVICES for the replica
and the engine inherits it. Serve's `check_health` runs a real generation (or trusts a
request that completed within `health.recent_traffic_s`); a dead or hung engine makes the
replica unhealthy and Serve replaces it. `__del__` stops the engine; the engine also has
PR_SET_PDEATHSIG, so it dies with a killed replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import tempfile
import time

import httpx
import ray
from ray import serve

from ddserve.api.app import freeze_startup_heap
from ddserve.api.observability import MeteredBackend, drafter_depth, engine_load
from ddserve.api.text import encode
from ddserve.backends.core import CoreBackend
from ddserve.backends.process import EngineProcess
from ddserve.backends.remote import RemoteBackend
from ddserve.config.deploy import Autoscaling, ServeConfig
from ddserve.engine.sampling import SamplingParams
from ddserve.errors import DDServeError, EngineError, EngineUnavailable
from ddserve.serve.api_process import DRAIN_S, ReplicaApiProcesses, replica_app
from ddserve.serve.autoscaling import METRIC, POLICY
from ddserve.serve.metrics import RayExporter, poll_engine_load
from ddserve.serve.registry import ReplicaRecord, ReplicaState, drop, publish

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        ctx = serve.get_replica_context()
        return ctx.replica_id.unique_id
    except Exception:  # outside a replica (unit tests)
        return f"local-{os.getpid()}"


@serve.ingress()
class EngineReplica:
    async def __init__(self, config: dict):
        self.cfg = ServeConfig.model_validate(config)
        self.replica_id = _replica_id()
        self.node_ip = ray.util.get_node_ip_address()
        ecfg = self.cfg.engine
        self.log_path = os.path.join(tempfile.gettempdir(), f"ddserve-engine-{self.replica_id}.log")
        self.attempt, self.verified_at, self.healthy_at = "", 0.0, 0.0
        self.engine = None
        self.api: ReplicaApiProcesses | None = None  # the extra API processes, if any
        self._publish(ReplicaState.STARTING)
        try:
            from ddserve.engine.weights import load_tokenizer

            spec = (
                (ecfg.sglang.tokenizer_path or ecfg.model) if ecfg.kind == "sglang" else ecfg.model
            )
            tokenizer = await asyncio.to_thread(load_tokenizer, spec)
            inner = await self._start_engine(ecfg, tokenizer)
            exporter = RayExporter(ecfg.model_id)
            self.backend = MeteredBackend(
                inner,
                exporter,
                drafter_depth=drafter_depth(ecfg.drafter.model_dump()),
                load=engine_load(inner),
            )
            await self.backend.refresh()
            if self.cfg.api_server_count > 1:
                self.api = ReplicaApiProcesses(self.cfg, self.replica_id, inner, exporter)
                await self.api.start()
        except BaseException as exc:
            if self.api is not None:
                await asyncio.to_thread(self.api.stop)
            if self.engine is not None:
                self.engine.stop()
            self._publish(ReplicaState.FAILED, f"engine start: {getattr(exc, 'message', exc)}")
            self._keep_record = True  # __del__ runs next; the controller needs this reason
            raise
        self.healthy_at = time.time()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.create_task(self._watch_engine())
        if self.api is not None:
            self._api_listen = loop.create_task(self._api_serve())
        freeze_startup_heap()
        log.info(
            "replica %s ready: engine pid %s at %s, fingerprint %s",
            self.replica_id,
            self.engine.pid,
            self.engine.url,
            self.backend.fingerprint,
        )

    async def _start_engine(self, ecfg, tokenizer):
        """The builtin engine: an engine core process on a private ZeroMQ channel (token ids
        in, token ids out, once per round; no second HTTP hop). SGLang: its own HTTP server
        on a loopback port, on the GPUs Ray gave this replica."""
        timeout = self.cfg.health.engine_start_timeout_s
        if ecfg.kind == "builtin":
            backend = await CoreBackend.start(
                ecfg,
                tokenizer,
                timeout=timeout,
                log_path=self.log_path,
                clients=self.cfg.api_server_count,
            )
            self.engine = backend.process
            return backend
        gpus = ray.get_gpu_ids()
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpus)}
        self.engine = EngineProcess(
            ecfg, admin_token=secrets.token_hex(16), log_path=self.log_path, env=env
        )
        self.engine.start()
        await asyncio.to_thread(self.engine.wait_ready, timeout)
        return RemoteBackend.for_config(
            self.engine.url, ecfg, tokenizer, admin_token=self.engine.admin_token
        )

    async def _api_serve(self) -> None:
        """Hand the extra API processes Serve's listening socket once it is open (after
        __init__ and the first reconfigure)."""
        from ray.serve._private import constants  # Ray is pinned (2.60.0)

        lo = constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT
        hi = constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
        pids = self.api.extras.pids if self.api.extras else []
        if await self.api.listen(range(lo, hi + 1)):
            log.info(
                "replica %s: %d API processes (pids %s and this one)",
                self.replica_id,
                self.cfg.api_server_count,
                pids,
            )
        else:
            log.warning("replica %s: %s", self.replica_id, self.api.note)

    def _die(self, msg: str) -> None:
        self._publish(ReplicaState.DEAD, msg)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def reconfigure(self, user_config: dict) -> None:
        """Serve calls this after __init__ and on every user_config change (a live
        reconfiguration): apply the live parameters to the engine, then prove them with a
        real generation that must return the new fingerprint. Raising fails the rollout."""
        t0 = time.monotonic()
        attempt = user_config.get("attempt", "")
        params = user_config.get("params") or self.backend.params.model_dump()
        try:
            expected = self.cfg.engine.with_params(**params).fingerprint()
            if params != self.backend.params.model_dump():
                await self.backend.update_params(params)
            fingerprint = await self._probe()
            if fingerprint != expected:
                raise EngineError(
                    f"engine answers with fingerprint {fingerprint}, expected {expected}"
                )
        except DDServeError as exc:
            self.backend.reconfigured(False, time.monotonic() - t0)
            self._publish(ReplicaState.FAILED, f"reconfigure {attempt}: {exc.message}")
            raise
        self.attempt, self.verified_at = attempt, time.time()
        self.backend.reconfigured(True, time.monotonic() - t0)
        self._publish(ReplicaState.RUNNING)

    async def _probe(self) -> str:
        """A real generation on this replica's engine with the live sampling defaults (sampled
        when the default temperature is > 0, so a default that breaks sampling fails here);
        returns its fingerprint."""
        prompt = encode(self.backend.tokenizer, "Hello") or [0]
        p = self.backend.inner.params
        sampling = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=2, ignore_eos=True
        )
        fp, n = "", 0
        async for d in self.backend.inner.stream(prompt, sampling):
            fp = d.fingerprint
            n += len(d.token_ids) or (d.stats.completion_tokens if d.stats else 0)
        if n < 1:
            raise EngineError("the verification generation returned no token")
        return fp

    def __serve_build_asgi_app__(self):
        return replica_app(self.backend, self.cfg, self.replica_id, (0, self.cfg.api_server_count))

    def _publish(self, state: ReplicaState, error: str = "") -> None:
        b = getattr(self, "backend", None)
        ctx = ray.get_runtime_context()
        publish(
            self.cfg.name,
            ReplicaRecord(
                replica=self.replica_id,
                state=state,
                error=error,
                node=self.node_ip,
                node_id=ctx.get_node_id(),
                actor=ctx.get_actor_name() or "",
                engine=self.cfg.engine.kind,
                engine_url=self.engine.url if self.engine else "",
                engine_pid=self.engine.pid if self.engine else None,
                fingerprint=b.fingerprint if b else "",
                params=b.params.model_dump() if b else {},
                attempt=self.attempt,
                verified_at=self.verified_at,
                healthy_at=self.healthy_at,
                updated=time.time(),
            ),
        )

    async def _watch_engine(self) -> None:
        """Keeps the metric gauges fresh (the engine's load read from its /metrics), and: an
        engine that exits takes its replica with it at once, so the proxy stops routing here
        within a second instead of at the next health check."""
        builtin = self.cfg.engine.kind == "builtin"
        msg = None
        async with httpx.AsyncClient() as client:
            while self.engine.alive():
                if builtin:  # the core sends its load with every round
                    self.backend.refresh_gauges()
                else:
                    self.backend.refresh_gauges(await poll_engine_load(client, self.engine.url))
                if self.api is not None and (msg := self.api.dead()):
                    break
                await asyncio.sleep(0.5)
        if msg is None:
            msg = f"engine process {self.engine.pid} exited with code {self.engine.proc.returncode}"
        log.error("%s; stopping replica %s so Serve replaces it", msg, self.replica_id)
        self._die(msg)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (ddserve.serve.autoscaling): the engine's
        running + waiting requests, from every API process of this replica."""
        load_fn = engine_load(self.backend.inner)
        if load_fn is None:  # an SGLang engine: Serve's own count (one API process)
            return {}
        load = load_fn()
        running, waiting = load.get("num_requests_running", 0), load.get("num_requests_waiting", 0)
        return {METRIC: float(running + waiting)}

    async def check_health(self) -> None:
        """Serve calls this every health.period_s: a real generation, or recent real traffic."""
        if not self.engine.alive():
            self._publish(ReplicaState.UNHEALTHY, "engine process exited")
            raise EngineUnavailable(
                f"engine process {self.engine.pid} exited with code {self.engine.proc.returncode}"
            )
        recent = time.monotonic() - self.backend.last_success < self.cfg.health.recent_traffic_s
        if not recent:
            try:
                await self.backend.check_health(timeout=self.cfg.health.timeout_s)
            except EngineUnavailable as exc:
                self._publish(ReplicaState.UNHEALTHY, exc.message)
                if self.api is not None:  # their /-/healthz says so too (HAProxy asks them)
                    self.api.set_healthy(False)
                raise
        if self.api is not None:
            self.api.set_healthy(True)
        self.healthy_at = time.time()
        self._publish(ReplicaState.RUNNING)

    async def __del__(self):
        api = getattr(self, "api", None)
        if api is not None:  # their streams finish first: they need the engine
            await asyncio.to_thread(api.stop, DRAIN_S)
        engine = getattr(self, "engine", None)
        if engine is not None:
            await asyncio.to_thread(engine.stop)
        b = getattr(self, "backend", None)
        if b is not None:
            await b.inner.aclose()
        if hasattr(self, "cfg") and not getattr(self, "_keep_record", False):
            drop(self.cfg.name, self.replica_id)


def deployment_options(cfg: ServeConfig) -> dict:
    """Serve deployment options from the config (pure: tested without a cluster)."""
    e = cfg.engine
    gpus = e.tp_size if e.kind == "sglang" else (1 if e.device == "cuda" else 0)
    opts: dict = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": gpus},
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "health_check_period_s": cfg.health.period_s,
        "health_check_timeout_s": cfg.health.timeout_s + 10,
        "graceful_shutdown_timeout_s": 120,
        "graceful_shutdown_wait_loop_s": 1,
        # rollouts: a bounded share of the replicas at a time (at least one); with surge, a
        # restarted replica's successor starts before it stops (capacity never dips)
        "rolling_update_percentage": cfg.rollout_batch_percent / 100,
        "max_surge_percent": cfg.rollout_surge_percent,
    }
    if gpus:
        # one bundle holding the replica and all its engine's GPUs, on one node
        opts["placement_group_bundles"] = [{"CPU": cfg.cpus_per_replica, "GPU": gpus}]
        opts["placement_group_strategy"] = "STRICT_PACK"
    if isinstance(cfg.replicas, Autoscaling):
        a = cfg.replicas
        opts["autoscaling_config"] = {
            "min_replicas": a.min,
            "max_replicas": a.max,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "metrics_interval_s": a.metrics_interval_s,
            "look_back_period_s": a.look_back_period_s,
        }
        if cfg.api_server_count > 1:  # Serve sees only the replica's own process's requests
            opts["autoscaling_config"]["policy"] = {"policy_function": POLICY}
    else:
        opts["num_replicas"] = cfg.replicas
    return opts


def build_app(cfg: ServeConfig, attempt: str = "deploy", params: dict | None = None):
    """Config -> Serve application (only serializable data crosses into the replicas).

    The live parameters travel twice: in the init config (what a new engine starts with)
    and as `user_config` (what `reconfigure` applies in place). A change of user_config
    alone is a live reconfiguration; any change of the init config restarts replicas."""
    user_config = {"params": params or cfg.engine.params.model_dump(), "attempt": attempt}
    init = cfg.model_dump(mode="json")
    deployment = serve.deployment(EngineReplica, **deployment_options(cfg), user_config=user_config)
    # Serve 2.60's Python API deploys every `serve.run` under a random code version (so
    # every redeploy restarts replicas) unless the deployment carries one; the public
    # `version=` argument is gone, so set the attribute it fed (Ray is pinned: 2.60.0).
    # Same init config -> same version -> Serve reconfigures the replicas in place.
    deployment._version = hashlib.sha256(json.dumps(init, sort_keys=True).encode()).hexdigest()[:16]
    return deployment.bind(init)
