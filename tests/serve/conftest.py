"""A real two-node Ray cluster on this machine (two raylets, loopback only) with the ddserve
application deployed: 2 replicas of the builtin engine on a tiny random model, one per node."""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's switch: node IP = 127.0.0.1
os.environ["RAY_metrics_report_interval_ms"] = "1000"  # metrics reach the agents within ~1 s
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["DDSERVE_THREADS"] = "1"
# LLM replicas are compute-bound: balance by load, not by the proxy's node (as `ddserve up` does)
os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"

import time  # noqa: E402

import pytest  # noqa: E402

from tests.api.conftest import free_port  # noqa: E402

MODEL = "tiny-random:7"


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    )
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        yield cluster
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    """Serve's HTTP proxy port: set once per cluster (Serve ignores later http_options)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="session")
def serve_app(ray_cluster, serve_port):
    """Deployed once for the session; returns (base url, ServeConfig)."""
    from ray import serve

    from ddserve.config.deploy import ServeConfig
    from ddserve.serve.replica import build_app

    port = serve_port
    cfg = ServeConfig.model_validate(
        {
            "name": "ddtest",
            "engine": {"model": MODEL, "max_context": 256, "params": {"budget": 6, "topk": 2}},
            "replicas": 2,
            "cpus_per_replica": 2,  # 2 CPUs per node: one replica per node
            "http": {"port": port},
            "health": {"period_s": 2, "timeout_s": 30, "recent_traffic_s": 2},
        }
    )
    t0 = time.time()
    serve.run(build_app(cfg), name=cfg.name, route_prefix="/")
    print(f"deployed in {time.time() - t0:.1f}s")
    return f"http://127.0.0.1:{port}", cfg
