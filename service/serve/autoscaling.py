"""Serve's autoscaling on the engine's own request count (a replica with extra API processes).

Serve counts a replica's ongoing requests in the replica's own process. With
`api_server_count` N, HAProxy spreads connections over all N API processes of a replica, and
the requests reaching the N-1 extra ones never pass through it: Serve's default policy would
see about 1/N of the load. The engine core sees every request of its replica, whichever
process it came through. So each replica reports its engine's running + waiting requests as a
custom autoscaling metric (`EngineReplica.record_autoscaling_stats`, Serve's hook), and this
policy sizes the deployment from their sum as Serve's default does from its own count:
replicas = total / target_ongoing_requests. Serve applies `min`/`max`, the up/down-scale
delays and the scaling factors around it (its wrapper of every custom policy). A replica
that has not reported yet adds Serve's own count of its requests.
"""

from __future__ import annotations

METRIC = "ddserve_engine_requests"  # running + waiting in a replica's engine core
POLICY = "ddserve.serve.autoscaling:engine_requests_policy"


def engine_requests_policy(ctx) -> tuple[float, dict]:
    """Desired replicas from the engines' requests (ray.serve.config.AutoscalingContext)."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    reported = (ctx.aggregated_metrics or {}).get(METRIC) or {}
    total = sum(reported.values())
    if len(reported) < ctx.current_num_replicas:
        # replicas without a report yet (just started): Serve's count stands in for theirs
        total = max(total, ctx.total_num_requests)
    return total / ctx.config.get_target_ongoing_requests(), {}
