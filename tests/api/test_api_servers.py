"""`ddserve engine --api-server-count N`: N API processes on one port over one engine core
(ddserve.cli.api_server), real processes and real HTTP: answers from every process are the
same at T=0, a live parameter change through one process is in force in every process when
it answers, /metrics sums every process's requests, a core that dies fails the streams of
every process within a second, and a process that dies takes the server down."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.api.conftest import running_engine
from tests.test_cli import ddserve, one_line

pytestmark = pytest.mark.slow

MODEL = ["--model", "tiny-random:7", "--max-context", "512"]


def pinned_clients(url: str, count: int, tries: int = 400) -> dict[int, httpx.Client]:
    """One keep-alive client per API process: a client of one connection keeps the process
    that accepted it (read from its /server_info)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(tries):
        c = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=1), timeout=60)
        index = c.get("/server_info").json()["api_server"]["index"]
        if index in found:
            c.close()
        else:
            found[index] = c
        if len(found) == count:
            return found
    for c in found.values():
        c.close()
    pytest.fail(f"only API processes {sorted(found)} of {count} accepted {tries} connections")


@pytest.fixture(scope="module")
def three():
    with running_engine(*MODEL, "--api-server-count", "3") as eng:
        clients = pinned_clients(eng.url, 3)
        try:
            yield eng, clients
        finally:
            for c in clients.values():
                c.close()


def test_every_process_answers_alike_and_metrics_sum_them(three):
    eng, clients = three
    before = metric(
        clients[0].get("/metrics").text,
        'ddserve:requests_total{model_name="tiny-random:7",status="ok"}',
    )
    body = {
        "model": "tiny-random:7",
        "prompt": "The capital of",
        "max_tokens": 16,
        "temperature": 0,
    }
    texts = {}
    for index, c in clients.items():
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts[index] = r.json()["choices"][0]["text"]
        info = c.get("/server_info").json()
        assert info["api_server"]["index"] == index and info["api_server"]["count"] == 3
    assert len(set(texts.values())) == 1, texts
    # every process's pid differs; the core is one
    infos = [c.get("/server_info").json() for c in clients.values()]
    assert len({i["api_server"]["pid"] for i in infos}) == 3
    assert len({i["engine_pid"] for i in infos}) == 1
    for c in clients.values():  # whichever process answers /metrics, it counts all three
        after = metric(
            c.get("/metrics").text, 'ddserve:requests_total{model_name="tiny-random:7",status="ok"}'
        )
        assert after - before == 3


def test_a_parameter_change_is_in_force_in_every_process_when_it_answers(three):
    eng, clients = three
    for via, temperature in ((1, 0.7), (0, 0.3), (2, 0.5), (1, 0.0)):
        r = clients[via].post(  # the change through one process ...
            "/admin/params",
            json={"temperature": temperature},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert r.status_code == 200, r.text
        fp = r.json()["system_fingerprint"]
        for index, c in clients.items():  # ... in force in all when it answers: no waiting
            info = c.get("/server_info").json()
            assert info["system_fingerprint"] == fp, (via, index)
            assert info["config"]["params"]["temperature"] == temperature
    # the live config gauge, summed: one config at 1
    text = clients[1].get("/metrics").text
    live = [
        ln
        for ln in text.splitlines()
        if ln.startswith("ddserve:config_info") and ln.endswith(" 1.0")
    ]
    assert len(live) == 1 and 'temperature="0.0"' in live[0], live


def test_concurrent_changes_through_every_process_leave_all_on_the_last(three):
    """Changes racing through different processes: whichever the core applied last is what
    every process holds afterwards (a caller's answer carries the parameters as they are
    when it leaves the core, not as its own change left them)."""
    eng, clients = three
    auth = {"Authorization": "Bearer s3cret"}
    for round_ in range(6):
        values = [round(0.1 + 0.05 * k + 0.01 * round_, 2) for k in range(6)]
        posts = [
            threading.Thread(
                target=lambda v=v, k=k: httpx.post(
                    eng.url + "/admin/params", json={"temperature": v}, headers=auth, timeout=60
                )
            )
            for k, v in enumerate(values)
        ]  # each on a connection of its own: spread over the processes
        for t in posts:
            t.start()
        for t in posts:
            t.join(60)
        seen = {i: c.get("/server_info").json() for i, c in clients.items()}
        temps = {i: d["config"]["params"]["temperature"] for i, d in seen.items()}
        fps = {d["system_fingerprint"] for d in seen.values()}
        assert len(set(temps.values())) == 1 and len(fps) == 1, (round_, temps)
    r = clients[0].post("/admin/params", json={"temperature": 0.0}, headers=auth)
    assert r.status_code == 200


def test_a_dying_core_fails_every_process_s_streams_within_a_second(three):
    """Last in the module: the server goes down with its core."""
    eng, clients = three
    core_pid = clients[0].get("/server_info").json()["engine_pid"]
    body = {
        "model": "tiny-random:7",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    threads, started, results = streams_on_every_process(clients, "/v1/chat/completions", body)
    killed: list[float] = []
    started.wait(60)
    os.kill(core_pid, signal.SIGKILL)
    killed.append(time.monotonic())
    for t in threads:
        t.join(30)
    for index, (error, at) in results.items():
        assert isinstance(error, dict) and "exited" in error["message"], (index, error)
        assert at - killed[0] < 1.0, (index, at - killed[0])
    assert len(results) == 3
    eng.proc.wait(30)  # the whole server goes down: a supervisor restarts it
    assert eng.proc.returncode != 0


def test_an_api_process_that_dies_takes_the_server_and_core_down():
    with running_engine(*MODEL, "--api-server-count", "2") as eng:
        clients = pinned_clients(eng.url, 2)
        info = clients[1].get("/server_info").json()
        for c in clients.values():
            c.close()
        os.kill(info["api_server"]["pid"], signal.SIGKILL)
        eng.proc.wait(30)
        assert eng.proc.returncode != 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and alive(info["engine_pid"]):
            time.sleep(0.1)
        assert not alive(info["engine_pid"])


def test_sigterm_drains_every_process_refuses_new_connections_and_cleans_up(tmp_path):
    """systemd's stop (KillMode=mixed: SIGTERM to the server's main process): streams in
    flight in every process finish, new connections are refused at once (no process keeps
    accepting on the shared port), everything exits (0), no temporary directory is left."""
    with running_engine(*MODEL, "--api-server-count", "2", env={"TMPDIR": str(tmp_path)}) as eng:
        clients = pinned_clients(eng.url, 2)
        core_pid = clients[0].get("/server_info").json()["engine_pid"]
        body = {
            "model": "tiny-random:7",
            "prompt": "hi",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        threads, started, results = streams_on_every_process(clients, "/v1/completions", body)
        started.wait(60)
        eng.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = 0
        for _ in range(5):  # fresh connections: whichever process would take them
            try:
                httpx.get(eng.url + "/server_info", timeout=2)
            except httpx.TransportError:
                refused += 1
        for t in threads:
            t.join(60)
        assert {i: r[0] for i, r in results.items()} == {0: "length", 1: "length"}, results
        assert refused == 5
        eng.proc.wait(30)
        assert eng.proc.returncode == 0
        assert not alive(core_pid)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ddserve-")] == []


@pytest.mark.parametrize(
    "args,env,needle",
    [
        (["--api-server-count", "0"], {}, "argument --api-server-count: 0 API processes"),
        (["--api-server-count", "two"], {}, "'two' is not a number of processes"),
        ([], {"DDSERVE_API_SERVER_COUNT": "99"}, "DDSERVE_API_SERVER_COUNT=99: 99 API processes"),
    ],
)
def test_a_bad_api_server_count_is_one_line(args, env, needle):
    line = one_line(ddserve("engine", *args, env=env), 2)
    assert needle in line, line


def streams_on_every_process(clients: dict, path: str, body: dict):
    """One stream through each pinned client, each in a thread; returns (threads, started,
    results) where `started` is a barrier the caller waits on too (every stream has its first
    chunk) and results[index] = (the error body or the finish reason, when it came)."""
    started = threading.Barrier(len(clients) + 1)
    results: dict[int, tuple] = {}

    def read(index: int, c: httpx.Client) -> None:
        first, finish = True, None
        with c.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    results[index] = (chunk["error"], time.monotonic())
                    return
                if first:
                    first = False
                    started.wait(30)
                finish = chunk["choices"][0]["finish_reason"] or finish
        results[index] = (finish, time.monotonic())

    threads = [threading.Thread(target=read, args=(i, c)) for i, c in clients.items()]
    for t in threads:
        t.start()
    return threads, started, results


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_the_api_server_count_comes_from_the_flag_its_variable_or_the_config(tmp_path, monkeypatch):
    """`ddserve engine --config X` serves with X's api_server_count (as its replicas would),
    unless --api-server-count or DDSERVE_API_SERVER_COUNT says otherwise; without any, 1."""
    import argparse

    import yaml

    from ddserve.cli.engine import API_SERVERS_ENV, api_servers_of

    with open("deploy/smollm2-gpu.yaml") as f:
        cfg = yaml.safe_load(f)
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump({**cfg, "api_server_count": 3}))
    monkeypatch.delenv(API_SERVERS_ENV, raising=False)

    def count(flag=None, config=None):
        return api_servers_of(argparse.Namespace(api_server_count=flag, config=config))

    assert count(config=str(path)) == 3
    assert count() == 1
    assert count(config="deploy/default.yaml") == 1
    assert count(flag=2, config=str(path)) == 2
    monkeypatch.setenv(API_SERVERS_ENV, "5")
    assert count(config=str(path)) == 5
