"""The engine core process and its channel (ddserve.engine.core, ddserve.backends.core), with a
real core process: outputs in order and complete, streams that coalesce without losing or
repeating a token, a cancelled stream frees its slot, and a core that dies fails the requests
in flight within a second (and takes `ddserve engine` down with a non-zero exit)."""

import asyncio
import json
import os
import signal
import sys
import time

import httpx
import pytest

from ddserve.backends.core import CoreBackend
from ddserve.backends.process import EngineProcess, free_port
from ddserve.config.engine import EngineConfig
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.weights import load_tokenizer

pytestmark = pytest.mark.slow

CFG = EngineConfig.model_validate(
    {
        "model": "tiny-random:7",
        "max_context": 256,
        "max_batch": 2,  # two slots: a leaked slot shows at once
        "params": {"budget": 4, "topk": 2},
    }
)
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def core():
    """One core process for the module, driven from one event loop."""
    loop = asyncio.new_event_loop()
    tok = load_tokenizer("tiny-random:7")
    backend = loop.run_until_complete(
        CoreBackend.start(CFG, tok, timeout=180, env={"DDSERVE_THREADS": "1"})
    )
    yield loop, backend
    loop.run_until_complete(backend.aclose())
    loop.close()


async def collect(backend, prompt, sampling=GREEDY, *, slow_s=0.0):
    deltas = []
    async for d in backend.stream(prompt, sampling):
        deltas.append(d)
        if slow_s:
            await asyncio.sleep(slow_s)  # a reader slower than the engine
    return deltas


def test_outputs_complete_in_order_and_coalesced_streams_lose_nothing(core):
    loop, backend = core
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]

    async def run():
        fast = await asyncio.gather(*(collect(backend, p) for p in prompts))
        slow = await asyncio.gather(*(collect(backend, p, slow_s=0.15) for p in prompts))
        return fast, slow

    fast, slow = loop.run_until_complete(run())
    for f, s in zip(fast, slow, strict=True):
        ids_f = [t for d in f for t in d.token_ids]
        ids_s = [t for d in s for t in d.token_ids]
        assert len(ids_f) == 40 and ids_s == ids_f  # greedy: same tokens, none lost or repeated
        assert "".join(d.text for d in s) == "".join(d.text for d in f)
        assert f[-1].finish_reason == s[-1].finish_reason == "length"
        assert f[-1].stats.completion_tokens == 40
        # the slow reader got several rounds per chunk: fewer, bigger chunks
        assert len(s) < len(f)


def test_a_stream_closed_mid_way_frees_its_slot(core):
    loop, backend = core

    async def run():
        for _ in range(3):  # more abandoned streams than the core has slots
            agen = backend.stream([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
        deadline = time.monotonic() + 5
        while backend.load_gauges().get("kv_slots_used") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        used = backend.load_gauges().get("kv_slots_used")
        done = await asyncio.wait_for(collect(backend, [4, 5, 6]), 60)
        return used, done

    used, done = loop.run_until_complete(run())
    assert used == 0
    assert done[-1].finish_reason == "length"


def test_live_params_and_bad_ids_over_the_channel(core):
    loop, backend = core
    from ddserve.errors import InvalidRequest

    async def run():
        before = backend.fingerprint
        await backend.update_params({"budget": 2})
        changed = backend.fingerprint
        with pytest.raises(InvalidRequest):
            await backend.update_params({"budget": -1})
        with pytest.raises(InvalidRequest):
            await collect(backend, [1, 10**9])
        await backend.update_params({"budget": 4})
        return before, changed

    before, changed = loop.run_until_complete(run())
    assert changed != before and backend.fingerprint == before
    assert backend.params.budget == 4


def test_a_dying_core_fails_streams_within_a_second_and_stops_the_server(tmp_path):
    port = free_port()
    eng = EngineProcess(
        None,
        port=port,
        log_path=tmp_path / "engine.log",
        env={"DDSERVE_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        command=[sys.executable, "-m", "ddserve", "engine", "--port", str(port),
                 "--model", "tiny-random:7", "--max-context", "512"],
    )  # fmt: skip
    eng.start()
    try:
        eng.wait_ready(180)
        core_pid = httpx.get(eng.url + "/server_info").json()["engine_pid"]
        body = {
            "model": "tiny-random:7",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "stream": True,
        }
        killed_at = None
        error = None
        with httpx.stream("POST", eng.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    break
                if killed_at is None:
                    os.kill(core_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        waited = time.monotonic() - killed_at
        assert error is not None and "exited" in error["message"], error
        assert waited < 1.0, waited
        eng.proc.wait(30)  # the server goes down with its core: a supervisor restarts it
        assert eng.proc.returncode != 0
    finally:
        eng.stop()


def test_a_core_whose_parent_is_gone_exits(tmp_path):
    """A core started by a process that then dies (here without the death signal asked for
    at spawn, so only the core's own watch can notice) exits by itself once it is ready and
    idle, instead of serving on, orphaned, holding its device."""
    import subprocess

    import zmq

    from ddserve.engine import ipc

    pidfile = tmp_path / "core.pid"
    env = {**os.environ, ipc.CONFIG_ENV: CFG.model_dump_json(), "DDSERVE_THREADS": "1"}
    starter = (
        "import os, subprocess, sys\n"
        f"os.environ[{ipc.PARENT_ENV!r}] = str(os.getpid())\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'ddserve.engine.core', "
        f"'ipc://{tmp_path}/in', 'ipc://{tmp_path}/out'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
    )
    subprocess.run([sys.executable, "-c", starter], env=env, check=True, timeout=60)
    pid = int(pidfile.read_text())
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"ipc://{tmp_path}/out")
    try:
        assert pull.poll(180_000), "the core never said it was ready"
        assert ipc.unpack(pull.recv())[0] == ipc.READY
        deadline = time.monotonic() + 20  # idle, it looks about once a second
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        pytest.fail("an orphaned engine core kept running")
    finally:
        pull.close(0)
        ctx.term()
