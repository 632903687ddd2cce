"""The deployment config (`deploy/*.yaml`): one engine config, replicas, HTTP, health.

    name: ddserve                 # Serve application name
    engine: {...}                 # ddserve.config.engine.EngineConfig
    replicas: 2                   # or {min: 1, max: 4, target_ongoing_requests: 4}
    http: {host: 127.0.0.1, port: 8000}
    admin_token_env: DDSERVE_ADMIN_TOKEN   # or DDSERVE_ADMIN_TOKEN_FILE; never in this file
    api_key_env: DDSERVE_API_KEY           # Bearer key of /v1/* and /generate; likewise
    health: {period_s: 10, timeout_s: 120, engine_start_timeout_s: 900}

`load_config(path)` validates once and returns a frozen model; any error is one line that
names the field, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from ddserve.config import api_key
from ddserve.config.admin_token import DEFAULT_ENV, read_admin_token
from ddserve.config.base import Frozen
from ddserve.config.engine import EngineConfig, validate
from ddserve.errors import ConfigError


class Autoscaling(Frozen):
    min: int = Field(1, ge=1, description="Fewest replicas.")
    max: int = Field(2, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="In-flight requests per replica that autoscaling aims for."
    )
    upscale_delay_s: float = Field(
        30.0,
        ge=0,
        description="How long the load must call for more replicas before Serve adds them (Serve's).",
    )
    downscale_delay_s: float = Field(
        600.0,
        ge=0,
        description="How long the load must call for fewer replicas before Serve removes them (Serve's).",
    )
    metrics_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often each replica reports its load to Serve's autoscaler (Serve's).",
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="The window over which Serve averages that load (Serve's)."
    )

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        if self.min > self.max:
            raise ValueError(f"replicas.min={self.min} > replicas.max={self.max}; make min <= max")
        return self


class HTTPConfig(Frozen):
    host: str = Field("127.0.0.1", description="Address of Serve's HTTP proxy.")
    port: int = Field(8000, ge=1, le=65535, description="Port of Serve's HTTP proxy.")
    ingress: Literal["proxy", "haproxy"] = Field(
        "proxy",
        description="Serve's HTTP ingress on a Ray head that `ddserve up` starts: `proxy` (Serve's Python proxy) or `haproxy` (Ray's HAProxy ingress with its throughput-optimised data plane: RAY_SERVE_ENABLE_HA_PROXY, RAY_SERVE_THROUGHPUT_OPTIMIZED). A cluster started elsewhere keeps the ingress it was started with.",
    )


class HealthConfig(Frozen):
    period_s: float = Field(
        10.0, gt=0, description="How often Serve runs each replica's health check."
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="A health check (a real generation) slower than this fails; long enough that long prefills do not trip it.",
    )
    recent_traffic_s: float = Field(
        10.0,
        ge=0,
        description="A replica that completed a real request this recently counts as healthy without a new probe (SGLang's health_generate rule).",
    )
    engine_start_timeout_s: float = Field(
        900.0, gt=0, description="Loading weights + first real generation must finish within this."
    )


class ServeConfig(Frozen):
    name: str = Field("ddserve", pattern=r"^[A-Za-z0-9_-]+$", description="Serve application name.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: int | Autoscaling = Field(1, description="A fixed count, or autoscaling bounds.")
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    admin_token_env: str = Field(
        DEFAULT_ENV,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the admin token (or `<VAR>_FILE`: a file holding it).",
    )
    api_key_env: str = Field(
        api_key.DEFAULT_ENV,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the API key that /v1/* and /generate require as `Authorization: Bearer` (or `<VAR>_FILE`: a file holding it); unset = no key.",
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests a replica accepts at once before Serve queues them."
    )
    api_server_count: int = Field(
        1,
        ge=1,
        le=64,
        description="API processes per replica (vLLM's --api-server-count): the replica's own and N-1 more on its port, over its one engine core; HTTP, JSON and detokenisation spread over N cores. Builtin engine with http.ingress: haproxy (Serve's direct ingress). With autoscaling replicas, Serve scales on each engine's running + waiting requests (every API process's; ddserve.serve.autoscaling), not on its count of the replica's own process.",
    )
    cpus_per_replica: float = Field(
        1.0, ge=0, description="Ray CPUs reserved per replica (its engine process included)."
    )
    rollout_surge_percent: int = Field(
        25,
        ge=0,
        le=100,
        description="Extra replicas (percent of the target, rounded up) a restart rollout may start before stopping old ones; needs spare resources. 0 = stop one, then start its successor (capacity dips by one replica).",
    )
    rollout_batch_percent: float = Field(
        25.0,
        gt=0,
        le=100,
        description="Replicas (percent of the target, at least one) changed at a time in a rollout.",
    )

    @model_validator(mode="after")
    def _replicas(self) -> ServeConfig:
        if isinstance(self.replicas, int) and self.replicas < 1:
            raise ValueError(
                f"replicas={self.replicas}: need at least 1 (or {{min, max}} for autoscaling)"
            )
        if self.api_server_count > 1 and self.engine.kind != "builtin":
            raise ValueError(
                f"api_server_count={self.api_server_count}: only a builtin engine's replica runs extra API processes (an SGLang engine serves its own HTTP); use 1"
            )
        if self.api_server_count > 1 and self.http.ingress != "haproxy":
            raise ValueError(
                f"api_server_count={self.api_server_count} needs http.ingress: haproxy (the extra API processes share the replica's own port, which only Serve's direct ingress gives it); use 1 with ingress: {self.http.ingress}"
            )
        return self

    @property
    def admin_token(self) -> str | None:
        """The token from `admin_token_env` (ddserve.config.admin_token's one rule)."""
        return read_admin_token(self.admin_token_env)

    @property
    def api_key(self) -> str | None:
        """The API key from `api_key_env` (the same rule as the admin token)."""
        return api_key.read_api_key(self.api_key_env)


def load_config(path: str | Path) -> ServeConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p} is not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{p}: its YAML nests too deeply") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of fields")
    try:
        return validate(ServeConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc.message}", param=exc.param) from exc
