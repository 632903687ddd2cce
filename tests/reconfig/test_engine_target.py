"""The controller against one bare engine under a supervisor (the single-box deployment).

systemd cannot run as PID 1 here; `ProcessSupervisor` stands in for it (same contract:
the engine reads an EnvironmentFile, the supervisor restarts it), and `RacingSupervisor`
reproduces the seed's race: after a restart the *old* process keeps answering on the
service address until the new one is up.
"""

import asyncio
import socket
import threading
import time

import httpx
import pytest

from ddserve.backends.process import EngineProcess, free_port
from ddserve.config.engine import EngineConfig
from ddserve.config.envfile import env_file_text, read_env_file
from ddserve.reconfig.controller import Controller
from ddserve.reconfig.engine_target import EngineTarget, ProcessSupervisor
from ddserve.reconfig.history import History

pytestmark = pytest.mark.slow
BASE = EngineConfig.model_validate(
    {"model": "tiny-random:7", "max_context": 256, "params": {"budget": 6, "topk": 2}}
)


class FrontDoor:
    """A TCP forwarder on the service address: what the client and controller call."""

    def __init__(self, backend_port: int):
        self.port = free_port()
        self.backend_port = backend_port
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self.loop
        ).result(5)

    async def _handle(self, reader, writer):
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, w2), pipe(r2, writer))


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class RacingSupervisor:
    """restart(): start the new engine; the old one keeps answering through the front door
    until the new one listens (systemd's window where the old process still answers)."""

    def __init__(self, env_file, front: FrontDoor, old: EngineProcess):
        self.env_file, self.front, self.old = env_file, front, old
        self.switched_at = None

    def restart(self) -> None:
        port = free_port()
        new = EngineProcess(
            None,
            port=port,
            env=read_env_file(self.env_file),
            command=["python3", "-m", "ddserve", "engine", "--port", str(port)],
        )
        new.start()

        def swap():
            while not port_open(port) and new.alive():
                time.sleep(0.05)
            self.front.backend_port = port
            self.switched_at = time.monotonic()
            self.old.stop()
            self.old = new

        threading.Thread(target=swap, daemon=True).start()


@pytest.fixture()
def single_box(tmp_path):
    env_file = tmp_path / "engine.env"
    env_file.write_text(env_file_text(BASE) + "DDSERVE_ADMIN_TOKEN=tok\n")
    port = free_port()
    sup = ProcessSupervisor(env_file, port)
    sup.start()
    sup.proc.wait_ready(120)
    history = History("engine-test", root=tmp_path / "state")
    history.save_deployed({"engine": BASE.model_dump(mode="json")})
    target = EngineTarget(f"http://127.0.0.1:{port}", env_file, sup, history, admin_token="tok")
    yield target, sup, history, env_file
    sup.stop()


def test_live_change_is_swapped_verified_and_written_to_the_env_file(single_box):
    target, sup, history, env_file = single_box
    pid = sup.proc.pid
    record = Controller(target, history, progress=lambda _: None).reconfigure(
        {"params.budget": 3, "params.topk": 1, "params.temperature": 0.4}
    )
    assert record["outcome"] == "succeeded" and record["plan"]["strategy"] == "live"
    assert sup.proc.pid == pid  # no restart
    assert (
        httpx.get(target.url + "/server_info").json()["system_fingerprint"]
        == record["to_fingerprint"]
    )
    env = read_env_file(env_file)
    assert (
        env["DDSERVE_BUDGET"] == "3"
        and env["DDSERVE_TOPK"] == "1"
        and env["DDSERVE_TEMPERATURE"] == "0.4"
    )


def test_restart_through_the_supervisor_and_failed_config_rolls_back(single_box):
    target, sup, history, env_file = single_box
    ctl = Controller(target, history, progress=lambda _: None)
    record = ctl.reconfigure({"drafter.depth": 4})
    assert record["outcome"] == "succeeded" and record["plan"]["strategy"] == "restart"
    good = record["to_fingerprint"]
    bad = ctl.reconfigure(
        {"drafter.kind": "draft-model", "drafter.draft_model": "/nonexistent/d.gguf"}, deadline_s=15
    )
    assert bad["outcome"] == "rolled_back", bad
    assert httpx.get(target.url + "/server_info").json()["system_fingerprint"] == good
    assert read_env_file(env_file)["DDSERVE_DRAFTER"] == "ngram"
    assert [r["outcome"] for r in history.records()] == ["succeeded", "rolled_back"]


def test_any_engine_field_reaches_the_engine_through_the_env_file(single_box):
    """drafter.ngram_max had no variable once: such a change could only time out and roll back."""
    target, sup, history, env_file = single_box
    pid = sup.proc.pid
    record = Controller(target, history, progress=lambda _: None).reconfigure(
        {"drafter.ngram_max": 2, "drafter.ngram_min": 2}, deadline_s=120
    )
    assert record["outcome"] == "succeeded" and record["plan"]["strategy"] == "restart", record
    assert sup.proc.pid != pid
    info = httpx.get(target.url + "/server_info").json()
    assert (
        info["config"]["drafter"]["ngram_max"] == 2 and info["config"]["drafter"]["ngram_min"] == 2
    )
    assert info["system_fingerprint"] == record["to_fingerprint"]
    env = read_env_file(env_file)
    assert env["DDSERVE_NGRAM_MAX"] == "2" and env["DDSERVE_NGRAM_MIN"] == "2"
    # the line ddserve does not own survives the rewrite: the new engine is still protected
    assert env["DDSERVE_ADMIN_TOKEN"] == "tok"
    assert httpx.post(target.url + "/admin/params", json={"budget": 3}).status_code == 401


def test_old_process_still_answering_is_not_taken_for_ready(tmp_path):
    env_file = tmp_path / "engine.env"
    env_file.write_text(env_file_text(BASE))
    old_port = free_port()
    old = EngineProcess(
        None,
        port=old_port,
        env=read_env_file(env_file),
        command=["python3", "-m", "ddserve", "engine", "--port", str(old_port)],
    )
    old.start()
    old.wait_ready(120)
    front = FrontDoor(old_port)
    sup = RacingSupervisor(env_file, front, old)
    history = History("race", root=tmp_path / "state")
    history.save_deployed({"engine": BASE.model_dump(mode="json")})
    target = EngineTarget(f"http://127.0.0.1:{front.port}", env_file, sup, history)
    try:
        record = Controller(target, history, progress=lambda _: None).reconfigure(
            {"drafter.depth": 5}
        )
        returned = time.monotonic()
        assert record["outcome"] == "succeeded"
        assert record["replicas"][0]["old_answers"] >= 1, (
            "the old process must have answered during the restart"
        )
        assert sup.switched_at is not None and returned >= sup.switched_at
        r = httpx.post(
            target.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        ).json()
        assert r["system_fingerprint"] == record["to_fingerprint"]
    finally:
        sup.old.stop()
