"""Reconfiguration target: the Ray Serve application.

How a plan maps onto Serve:
  live     redeploy with the same init config and a new `user_config`: Serve calls each
           replica's `reconfigure()` in place, `rolling_update_percentage` of them at a time;
           the replica swaps the engine's live parameters and proves them with a real
           generation (non-empty, new fingerprint) before it returns.
  restart  redeploy with a new init config: Serve rolls replicas (`max_surge_percent`: the
           successor starts, and must pass a real generation in its constructor, before the
           old replica drains and stops; in-flight requests finish).
Verification here: every running replica reports this attempt's id and the expected
fingerprint (from its own real generation), no replica of the old config is left, and
real requests through the HTTP proxy come back with the new fingerprint.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import httpx

from ddserve.config import api_key
from ddserve.config.deploy import ServeConfig
from ddserve.config.engine import EngineConfig
from ddserve.errors import RolloutFailed
from ddserve.reconfig.history import HistoryStore
from ddserve.reconfig.plan import Plan
from ddserve.serve.registry import ReplicaRecord, ReplicaState


def token_digest(token: str | None) -> str:
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


class RayTarget:
    name = "ray"

    def __init__(self, fallback: ServeConfig, history: HistoryStore):
        self.history = history
        state = history.deployed()
        self.init_cfg = ServeConfig.model_validate(state["serve_config"]) if state else fallback
        self.live = state["params"] if state else fallback.engine.params.model_dump()
        self.admin_sha = state.get("admin_sha", "") if state else ""

    @property
    def app_name(self) -> str:
        return self.init_cfg.name

    def current_config(self) -> EngineConfig:
        return self.init_cfg.engine.with_params(**self.live)

    def record_deployed(
        self, init_cfg: ServeConfig, params: dict, admin_sha: str | None = None
    ) -> None:
        self.init_cfg, self.live = init_cfg, params
        if admin_sha is not None:
            self.admin_sha = admin_sha
        self.history.save_deployed(
            {
                "serve_config": init_cfg.model_dump(mode="json"),
                "params": params,
                "admin_sha": self.admin_sha,
            }
        )

    def observe(self) -> list[ReplicaRecord]:
        """The application's replicas, each with its effective state (serve.registry)."""
        from ddserve.serve.registry import replica_view

        return replica_view(self.app_name, self.init_cfg.health.period_s)

    def apply(
        self,
        desired: EngineConfig,
        plan: Plan,
        attempt: str,
        deadline_s: float,
        progress: Callable[[str], None],
    ) -> list[dict]:
        from ray import serve

        from ddserve.serve.replica import build_app

        # live: the same init args as deployed (Serve reconfigures in place); restart: new ones
        init_cfg = (
            self.init_cfg
            if plan.strategy == "live"
            else self.init_cfg.model_copy(update={"engine": desired})
        )
        app = build_app(init_cfg, attempt=attempt, params=desired.params.model_dump())
        started = time.time()
        serve.run_many(
            [serve.RunTarget(app, name=self.app_name, route_prefix="/")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
        replicas = self._wait_verified(
            desired.fingerprint(), attempt, started, deadline_s, progress
        )
        self._verify_through_proxy(desired.fingerprint())
        self.record_deployed(init_cfg, desired.params.model_dump())
        return [r.to_dict() for r in replicas]

    def _wait_verified(
        self, expected: str, attempt: str, started: float, deadline_s: float, progress
    ) -> list[ReplicaRecord]:
        from ray import serve

        announced: set[str] = set()
        while time.time() < started + deadline_s:
            states = self.observe()
            running = [r for r in states if r.state == ReplicaState.RUNNING]
            done = [r for r in running if r.attempt == attempt and r.fingerprint == expected]
            for r in done:
                if r.replica not in announced:
                    announced.add(r.replica)
                    progress(
                        f"  replica {r.replica} ({r.node}): verified by a real generation, {time.time() - started:.1f}s"
                    )
            old = [r for r in running if r not in done]
            app = serve.status().applications.get(self.app_name)
            status = str(app.status) if app else "MISSING"
            failures = [
                r for r in states if r.state == ReplicaState.FAILED and r.updated >= started
            ]
            if len(failures) >= 2:  # Serve retried the constructor and it failed again
                raise RolloutFailed(
                    f"new replicas fail to start: {self._last_failure(started)}", _dicts(done)
                )
            if status.endswith("DEPLOY_FAILED"):
                raise RolloutFailed(
                    f"Serve reports the deployment failed: {self._last_failure(started) or _serve_error(app)}",
                    _dicts(done),
                )
            if done and not old and status.endswith("RUNNING"):
                serving = sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())
                if serving == len(done):
                    return done
            time.sleep(0.25)
        reason = self._last_failure(started) or "replicas did not verify the new config in time"
        raise RolloutFailed(
            f"not verified within {deadline_s:.0f}s: {reason}",
            _dicts([r for r in self.observe() if r.replica in announced]),
        )

    def _last_failure(self, since: float) -> str:
        failed = [
            r for r in self.observe() if r.state == ReplicaState.FAILED and r.updated >= since
        ]
        return max(failed, key=lambda r: r.updated).error if failed else ""

    def _verify_through_proxy(self, expected: str, n: int = 4) -> None:
        h = self.init_cfg.http
        host = "127.0.0.1" if h.host in ("0.0.0.0", "::") else h.host
        body = {
            "model": self.init_cfg.engine.model_id,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 2,
        }
        for _ in range(n):
            r = httpx.post(
                f"http://{host}:{h.port}/v1/chat/completions",
                json=body,
                headers=api_key.bearer(self.init_cfg.api_key),  # the proxy's replicas check it
                timeout=60,
            )
            if (
                r.status_code != 200
                or r.json().get("system_fingerprint") != expected
                or not r.json()["choices"][0]["message"]["content"]
            ):
                raise RolloutFailed(
                    f"a request through the proxy got HTTP {r.status_code}, fingerprint {r.json().get('system_fingerprint')!r}, expected {expected}"
                )


def _dicts(records: list[ReplicaRecord]) -> list[dict]:
    return [r.to_dict() for r in records]


def _serve_error(app) -> str:
    """The most telling line of Serve's status messages (the constructor's exception)."""
    text = "\n".join([app.message or ""] + [d.message or "" for d in app.deployments.values()])
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else lines[-1] if lines else "no message")[:500]
