"""A real Prometheus server (Debian package) scraping the Ray cluster of the tests."""

import contextlib
import subprocess
import time
from pathlib import Path

import httpx

from tests.api.conftest import free_port

SD_FILE = Path("/tmp/ray/session_latest/prom_metrics_service_discovery.json")


@contextlib.contextmanager
def prometheus(tmp_path: Path):
    """Start Prometheus with deploy/prometheus.yml (1 s scrapes, this session's SD file)."""
    assert SD_FILE.exists()
    conf = (Path(__file__).parents[2] / "deploy" / "prometheus.yml").read_text()
    conf = (
        conf.replace("scrape_interval: 5s", "scrape_interval: 1s")
        .replace("refresh_interval: 5s", "refresh_interval: 1s")
        .replace("/tmp/ray/prom_metrics_service_discovery.json", str(SD_FILE))
    )
    (tmp_path / "prometheus.yml").write_text(conf)
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
