"""Two engine servers side by side, one machine, one run: A/B of the served path.

    python -m ddserve.bench.served_ab --a-pythonpath /tmp/before-pp --engine-args "--drafter dflash --budget 3 --topk 1" \
        --bench-args "--concurrency 1 --requests 16 --max-tokens 96 --prompts mixed" --passes 3 --out DIR

A is `ddserve engine` from another checkout (its import root on `--a-pythonpath`: a folder
holding `ddserve`, e.g. links as bench/device_env.sh makes them) or, without it, this checkout
with other flags (`--a-args` / `--b-args`, after `--engine-args`); B this checkout. Both load
first and stay up (an idle server costs nothing measurable); then each pass runs this
checkout's `ddserve bench` against A and against B, the order alternating per pass, so drift
of the machine falls on both alike. DIR/ab.json: per pass and side the level's tok/s, TTFT
and ITL p50, the CPU each server's API process (the HTTP server; not its engine core) and its
engine core spent per output token over the pass, the medians and B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from ddserve.backends.process import EngineProcess
from ddserve.errors import ConfigError

FIELDS = (
    "output_tok_s",
    "ttft_ms_p50",
    "itl_ms_p50",
    "itl_ms_p99",
    "tau_mean",
    "api_cpu_us_per_token",
    "core_cpu_us_per_token",
)
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (/proc/PID/stat); None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


def measured_bench(eng: EngineProcess, run) -> tuple[float, float]:
    """run(); the CPU seconds the server's API process and its engine core (the children it
    had when the run began: a child that exits meanwhile is left out) spent over it."""
    kids = children(eng.pid)
    api0, core0 = cpu_s(eng.pid), {c: cpu_s(c) for c in kids}
    run()
    api1 = cpu_s(eng.pid)
    core = 0.0
    for c, before in core0.items():
        after = cpu_s(c)
        if before is not None and after is not None:
            core += after - before
    return (api1 or 0.0) - (api0 or 0.0), core


def start(name: str, port: int, engine_args: str, pythonpath: str | None, extra: dict, out: Path):
    """`ddserve engine` of one side (ddserve.backends.process.EngineProcess: its own process
    group, ready only after a real generation); `pythonpath` puts another checkout first."""
    env = dict(extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "ddserve", "engine", "--port", str(port)]
    eng = EngineProcess(
        None,
        port=port,
        log_path=out / f"{name}-engine.log",
        env=env,
        command=[*cmd, *shlex.split(engine_args)],
    )
    eng.start()
    return eng


def bench(eng: EngineProcess, bench_args: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ddserve", "bench", "--url", eng.url, "--out", str(out)]
    api_s, core_s = measured_bench(
        eng, lambda: subprocess.run([*cmd, "--no-progress", *shlex.split(bench_args)], check=True)
    )
    level = json.loads((out / "bench.json").read_text())["levels"]
    level = level[0] if isinstance(level, list) else level
    # the warm-up's tokens are not in output_tokens: a small overestimate, alike on both sides
    tokens = max(level.get("output_tokens") or 0, 1)
    level["api_cpu_us_per_token"] = round(api_s / tokens * 1e6, 1)
    level["core_cpu_us_per_token"] = round(core_s / tokens * 1e6, 1)
    return {k: level.get(k) for k in FIELDS}


def _median(values: list) -> float | None:
    """Median of the values a side reported (None where it reported none: e.g. no tau)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--a-pythonpath", default=None, help="import root of side A's checkout (default: this one)"
    )
    ap.add_argument(
        "--a-env",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="environment of side A only (e.g. DDSERVE_CACHE=DIR: another checkout may not "
        "read this one's converted weights)",
    )
    ap.add_argument("--a-name", default="before")
    ap.add_argument("--b-name", default="after")
    ap.add_argument("--engine-args", default="", help="`ddserve engine` flags for both sides")
    ap.add_argument("--a-args", default="", help="more `ddserve engine` flags for side A")
    ap.add_argument("--b-args", default="", help="more `ddserve engine` flags for side B")
    ap.add_argument("--bench-args", default="--concurrency 1 --requests 16 --max-tokens 96")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--port", type=int, default=30301, help="A's port; B's is the next")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.a_pythonpath and not (Path(args.a_pythonpath) / "ddserve").is_dir():
        raise ConfigError(f"--a-pythonpath {args.a_pythonpath}: no ddserve folder in it")
    args.out.mkdir(parents=True, exist_ok=True)
    a_env = dict(kv.split("=", 1) for kv in args.a_env)
    sides = {
        args.a_name: (args.port, args.a_pythonpath, a_env, args.a_args),
        args.b_name: (args.port + 1, None, {}, args.b_args),
    }
    procs = {
        n: start(n, p, f"{args.engine_args} {more}", pp, e, args.out)
        for n, (p, pp, e, more) in sides.items()
    }
    runs: dict[str, list[dict]] = {n: [] for n in sides}
    try:
        for eng in procs.values():
            eng.wait_ready(900)
        for i in range(args.passes):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                r = bench(procs[name], args.bench_args, args.out / f"{name}-pass{i}")
                runs[name].append(r)
                print(f"pass {i} {name}: " + "  ".join(f"{k} {r[k]}" for k in FIELDS), flush=True)
                (args.out / "passes.json").write_text(json.dumps(runs, indent=1))  # so far
    finally:
        for eng in procs.values():
            eng.stop()
    med = {n: {k: _median([r[k] for r in rs]) for k in FIELDS} for n, rs in runs.items()}
    a, b = med[args.a_name], med[args.b_name]
    result = {
        "engine_args": args.engine_args,
        "a_args": args.a_args,
        "b_args": args.b_args,
        "a_pythonpath": args.a_pythonpath,
        "bench_args": args.bench_args,
        "a": args.a_name,
        "b": args.b_name,
        "passes": runs,
        "median": med,
        "b_over_a_tok_s": round(b["output_tok_s"] / a["output_tok_s"], 3),
        "b_over_a_api_cpu": (
            round(b["api_cpu_us_per_token"] / a["api_cpu_us_per_token"], 3)
            if a["api_cpu_us_per_token"]
            else None
        ),
    }
    (args.out / "ab.json").write_text(json.dumps(result, indent=1))
    print(
        f"median tok/s {args.a_name} {a['output_tok_s']:.2f}  {args.b_name} "
        f"{b['output_tok_s']:.2f}  {args.b_name}/{args.a_name} {result['b_over_a_tok_s']}; API "
        f"CPU per token {a['api_cpu_us_per_token']} / {b['api_cpu_us_per_token']} us "
        f"({result['b_over_a_api_cpu']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
