import contextlib
import os
import sys
import tempfile

import pytest

from ddserve.backends.process import EngineProcess, free_port

__all__ = ["free_port"]  # the other test packages take loopback ports from here


@contextlib.contextmanager
def running_engine(*args: str, env: dict | None = None):
    """A real engine server process on loopback: a tiny random model with SmolLM2's tokenizer
    (`env`: more variables for it)."""
    port = free_port()
    log = os.path.join(tempfile.mkdtemp(prefix="ddserve-test-"), "engine.log")
    eng = EngineProcess(
        None,
        port=port,
        log_path=log,
        env={
            "DDSERVE_THREADS": "1",
            "DDSERVE_ADMIN_TOKEN": "s3cret",
            **(env or {}),
        },  # never on argv
        command=[sys.executable, "-m", "ddserve", "engine", "--port", str(port), *args],
    )
    eng.start()
    try:
        eng.wait_ready(180)  # a real generation, not "the port answers"
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="session")
def engine_server():
    with running_engine(
        "--model",
        "tiny-random:7",
        "--max-context",
        "256",
        "--budget",
        "6",
        "--topk",
        "2",
    ) as eng:
        yield eng


HF_KEY = "k-hf-9d1"


@pytest.fixture(scope="session")
def hf_engine(tmp_path_factory):
    """`ddserve engine --model DIR` on a tiny random Llama written by transformers as a Hugging
    Face directory (sharded safetensors, SmolLM2's tokenizer and chat template), with an API
    key, the access log on, a stats line every 0.2 s and a stream chunk per 3 tokens. Yields
    (engine, directory)."""
    from ddserve.engine.weights import load_tokenizer
    from tests.engine.test_hf_models import write_tiny_llama

    directory = tmp_path_factory.mktemp("hf-llama")
    write_tiny_llama(directory, load_tokenizer("smollm2-135m"))
    key_file = directory.parent / "api-key"
    key_file.write_text(HF_KEY)
    flags = ["--access-log", "--stats-interval", "0.2", "--api-key-file", str(key_file)]
    flags += ["--stream-interval", "3"]
    with running_engine("--model", str(directory), "--max-context", "128", *flags) as eng:
        yield eng, directory
