"""Autoscaling on the engine's request count (ddserve.serve.autoscaling): a replica with
extra API processes reports its engine's running + waiting requests to Serve, whose policy
sizes the deployment from their sum. Ray's own AutoscalingConfig validates the deployment's
options, resolves the policy by its import path and wraps it (bounds, delays) as Serve's
controller does."""

from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from ddserve.config.deploy import ServeConfig
from ddserve.serve.autoscaling import METRIC, engine_requests_policy
from ddserve.serve.replica import deployment_options


def _config(api_server_count: int) -> AutoscalingConfig:
    cfg = ServeConfig.model_validate(
        {
            "api_server_count": api_server_count,
            "http": {"ingress": "haproxy"},
            "replicas": {"min": 1, "max": 4, "target_ongoing_requests": 8, "upscale_delay_s": 0},
        }
    )
    return AutoscalingConfig(**deployment_options(cfg)["autoscaling_config"])


def _ctx(config, replicas: int, serve_count: float, engines: list[float] | None):
    ids = [f"r{i}" for i in range(replicas)]
    metrics = {METRIC: dict(zip(ids, engines, strict=False))} if engines is not None else {}
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="EngineReplica",
        app_name="ddserve",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=ids,
        total_num_requests=serve_count,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=100.0,
        config=config,
    )


def test_extra_api_processes_scale_on_the_engines_count():
    config = _config(4)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    # Serve sees the replica's own process only (6 of 24): the engine counts all of them
    replicas, _ = policy(_ctx(config, 1, 6, [24.0]))
    assert replicas == 3  # 24 / 8
    # the sum over replicas (the controller then holds it within min/max)
    assert policy(_ctx(config, 2, 10, [40.0, 40.0]))[0] == 10
    # a replica that has not reported yet: Serve's count stands in
    assert engine_requests_policy(_ctx(config, 2, 16, [8.0]))[0] == 2.0
    assert engine_requests_policy(_ctx(config, 1, 16, None))[0] == 2.0


def test_one_api_process_keeps_serves_own_policy():
    config = _config(1)
    assert config.policy.is_default_policy_function()
    resolved = _config(2).policy.get_policy()
    assert (resolved.__module__, resolved.__name__) == (
        "ddserve.serve.autoscaling",
        "engine_requests_policy",
    )
