"""A real Prometheus server (Debian package) with deploy/prometheus.yml, scraping the Ray
cluster of the tests and/or bare engine servers."""

import contextlib
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from tests.api.conftest import free_port

SD_FILE = Path("/tmp/ray/session_latest/prom_metrics_service_discovery.json")


@contextlib.contextmanager
def prometheus(tmp_path: Path, *, ray: bool = True, engines: tuple[str, ...] = ()):
    """Start Prometheus with deploy/prometheus.yml's jobs (1 s scrapes): `ray` with this
    session's SD file, and the `ddserve-engine` job on `engines` (host:port); a job not
    asked for is left out, so nothing else on this machine is scraped."""
    conf = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "prometheus.yml").read_text())
    conf["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    conf["scrape_configs"] = []
    if ray:
        assert SD_FILE.exists()
        jobs["ray"]["file_sd_configs"] = [{"files": [str(SD_FILE)], "refresh_interval": "1s"}]
        conf["scrape_configs"].append(jobs["ray"])
    if engines:
        jobs["ddserve-engine"]["static_configs"] = [{"targets": list(engines)}]
        conf["scrape_configs"].append(jobs["ddserve-engine"])
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(conf))
    check = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def promtool_check_queries(tmp_path: Path, queries: list[tuple[str, str]]) -> None:
    """Every query parses (promtool, as recording rules)."""
    rules = tmp_path / "rules.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "panels",
                        "rules": [
                            {"record": f"panel_{i}", "expr": q} for i, (_, q) in enumerate(queries)
                        ],
                    }
                ]
            }
        )
    )
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def dashboard_queries(ray: bool) -> list[tuple[str, str]]:
    """The committed dashboard's panel and variable queries, as Prometheus runs them."""
    from ddserve.dashboards.ddserve_dashboard import panel_queries, variable_queries
    from ddserve.dashboards.render_png import grafana_to_promql

    out = [(t, grafana_to_promql(q)) for t, q in panel_queries(ray=ray)]
    variables = [(f"${n}", grafana_to_promql(q)) for n, q in variable_queries()]
    # a bare engine belongs to no Serve application: $application has values on Ray only
    return out + [(n, q) for n, q in variables if ray or n != "$application"]


def without_data(url: str, queries: list[tuple[str, str]], timeout: float) -> list:
    """The queries that still return no series (empty or only label-less) after `timeout`."""
    deadline, empty = time.time() + timeout, queries
    while True:
        empty = [
            (t, q)
            for t, q in empty
            if not [s for s in query(url, q) if s["metric"] or not t.startswith("$")]
        ]
        if not empty or time.time() > deadline:
            return empty
        time.sleep(1)
