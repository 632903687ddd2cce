"""`ddserve` command line: `ddserve engine ...` runs one builtin engine server;
`ddserve chat MESSAGE` asks a running server. Bad input exits non-zero with one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from service.errors import DDServeError


def _engine_parser(sub) -> None:
    p = sub.add_parser("engine", help="run one builtin DDTree engine server (FastAPI + uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m | tiny-random[:SEED] | FILE.gguf | converted DIR",
    )
    p.add_argument(
        "--served-name", default=None, help="model id in the OpenAI API (default: --model)"
    )
    p.add_argument("--drafter", default="ngram", help="ngram | draft-model | layer-skip | none")
    p.add_argument(
        "--draft-model", default=None, help="model spec of the draft model (--drafter draft-model)"
    )
    p.add_argument(
        "--draft-layers", type=int, default=8, help="target layers kept by --drafter layer-skip"
    )
    p.add_argument(
        "--depth", type=int, default=8, help="draft positions per round (tree depth limit)"
    )
    p.add_argument(
        "--budget",
        type=int,
        default=8,
        help="draft tree nodes verified per round; 0 = autoregressive",
    )
    p.add_argument("--topk", type=int, default=4, help="candidates per depth")
    p.add_argument("--window", type=int, default=2048, help="drafter attention window (tokens)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="default temperature (0 = greedy)"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("DDSERVE_ADMIN_TOKEN"),
        help="required by POST /admin/params (env DDSERVE_ADMIN_TOKEN)",
    )
    p.add_argument("--log-level", default="info")


def engine_config_from_args(a: argparse.Namespace):
    from service.config import EngineConfig, validate

    return validate(
        EngineConfig,
        {
            "model": a.model,
            "served_name": a.served_name,
            "max_context": a.max_context,
            "device": a.device,
            "dtype": a.dtype,
            "drafter": {
                "kind": a.drafter,
                "draft_model": a.draft_model,
                "layers": a.draft_layers,
                "depth": a.depth,
            },
            "params": {
                "budget": a.budget,
                "topk": a.topk,
                "window": a.window,
                "temperature": a.temperature,
                "top_p": a.top_p,
                "top_k": a.top_k,
            },
        },
    )


def run_engine(a: argparse.Namespace) -> None:
    import uvicorn

    from service.engine.runner import EngineRunner
    from service.server.app import create_app
    from service.server.backend import LocalBackend

    config = engine_config_from_args(a)
    torch_threads = os.environ.get("DDSERVE_THREADS")
    if torch_threads:
        import torch

        torch.set_num_threads(int(torch_threads))
    runner = EngineRunner(config)
    runner.start()
    app = create_app(LocalBackend(runner), admin_token=a.admin_token)
    print(
        f"ddserve engine: {config.model_id} on http://{a.host}:{a.port} (fingerprint {runner.fingerprint})",
        flush=True,
    )
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False)
    finally:
        runner.shutdown()


def run_chat(a: argparse.Namespace) -> None:
    import httpx

    base = a.url.rstrip("/")
    model = a.model or httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": a.message}],
        "max_tokens": a.max_tokens,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    data = r.json()
    if r.status_code != 200:
        raise DDServeError(data.get("error", {}).get("message", r.text))
    print(data["choices"][0]["message"]["content"])
    dd, u = data.get("ddtree", {}), data["usage"]
    print(
        f"-- {u['completion_tokens']} tokens, accept length {dd.get('accept_length')}, fingerprint {data['system_fingerprint']}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddserve", description="DDTree speculative decoding server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _engine_parser(sub)
    c = sub.add_parser(
        "chat", help="send one chat message to a running server and print the answer"
    )
    c.add_argument("message")
    c.add_argument("--url", default="http://127.0.0.1:30000")
    c.add_argument("--model", default=None)
    c.add_argument("--max-tokens", type=int, default=128)
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(a, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if a.command == "engine":
            run_engine(a)
        elif a.command == "chat":
            run_chat(a)
    except DDServeError as exc:
        print(f"ddserve: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
