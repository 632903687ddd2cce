import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "service.cli", "engine", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "DDSERVE_THREADS": "1"},
        )

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {self.proc.stdout.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("engine did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def engine_server():
    """A real engine server process on loopback: a tiny random model with SmolLM2's tokenizer."""
    eng = EngineProcess(
        "--model",
        "tiny-random:7",
        "--max-context",
        "256",
        "--budget",
        "6",
        "--topk",
        "2",
        "--admin-token",
        "s3cret",
    )
    try:
        eng.wait_ready()
        yield eng
    finally:
        eng.stop()
