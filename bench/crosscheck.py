"""`ddserve bench` next to guidellm, an established third-party load client, on one server.

    python -m ddserve.bench.crosscheck --guidellm /work/venv-guidellm/bin/guidellm \\
        [--levels 1,4,64] [--engine] [--repeats 2] [--out bench/results/crosscheck-cpu] [--runs DIR]

guidellm lives in a virtualenv of its own (a benchmark tool, not a dependency of ddserve):
`python3 -m venv /work/venv-guidellm && /work/venv-guidellm/bin/pip install 'guidellm>=0.8,<0.9'`.

Servers: the stub (bench/stub_server.py: first token after 100 ms, then one every 20 ms: the
ideal tok/s is known) and, with --engine, the builtin engine on the tiny random model
(`ddserve engine --model tiny-random:7`, autoregressive, max batch 64, one torch thread,
warmed up first). Per level both clients send the same max(8, 4C) streaming chat requests
(the same 32-word synthetic prompts in the same order, 64 output tokens, ignore_eos) at
concurrency C, one client after the other, ddserve first, with no warm-up: guidellm's
warm-up trims a time window, ours runs requests to completion first; without one both
clocks are the same, the first request's start to the last one's end. On the stub the top
level runs once more with 256-token answers (2C requests), which dilutes a client's fixed
cost per request. `--repeats 2` runs each client twice per level, in the order ddserve,
guidellm, guidellm, ddserve, and reports the means.

Reported per level: each client's output tok/s and their ratio; the ideal (stub); TTFT and ITL
p50; the mean number of requests in flight over each window (C for a client that wastes no
time between a response's end and its next request) and tok/s per request in flight (the
server's speed as each client saw it, its own dead time taken out); the server's CPU over
each window and tokens per server CPU second (a CPU-bound server that shares the machine
with the client runs slower next to a client that takes more of the cores); each client's
own CPU over its window (ours from its report, guidellm's process tree sampled every
0.25 s); the load average (other work on the machine). Writes crosscheck.json and
crosscheck.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ddserve.backends.process import free_port
from ddserve.bench.prompts import synthetic_prompts
from ddserve.bench.stub_server import ideal

TTFT_MS, ITL_MS, TOKENS, LONG_TOKENS, PROMPT_TOKENS = 100.0, 20.0, 64, 256, 32


def start_server(kind: str, port: int, log: Path) -> subprocess.Popen:
    if kind == "stub":
        args = ["-m", "ddserve.bench.stub_server", "--ttft-ms", str(TTFT_MS)]
        args += ["--itl-ms", str(ITL_MS), "--tokens", str(TOKENS)]
    else:
        args = ["-m", "ddserve", "engine", "--model", "tiny-random:7", "--drafter", "none"]
        args += ["--budget", "0", "--max-batch", "64", "--max-context", "512"]
    # one torch thread: on a shared machine an oversubscribed OpenMP team spins, and the
    # engine's speed then swings far more between runs than the clients could differ
    env = {**os.environ, "DDSERVE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    for _ in range(600):
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"{kind} server did not come up; see {log}")


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU seconds so far of a process (/proc/PID/stat), with `tree` of it and
    every live descendant (guidellm's worker processes)."""
    stats = {}
    for d in Path("/proc").iterdir() if tree else [Path(f"/proc/{pid}")]:
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if d.name.isdigit():
            stats[int(d.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    family, grew = {pid}, True
    while grew:
        more = {p for p, (parent, _) in stats.items() if parent in family} - family
        family, grew = family | more, bool(more)
    return sum(stats[p][1] for p in family if p in stats) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """A process tree's CPU seconds sampled against wall-clock time, so that the CPU inside
    a window known only afterwards (guidellm's benchmark start and end) can be read off."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.samples.append((time.time(), cpu_seconds(self.pid, tree=True)))

    def between(self, t0: float, t1: float) -> float:
        def at(t):  # the last sample at or before t (CPU seconds only grow)
            return max((cpu for ts, cpu in self.samples if ts <= t), default=0.0)

        return at(t1) - at(t0)


def run_ddserve(url: str, c: int, n: int, tokens: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ddserve", "bench", "--no-progress", "--url", url]
    cmd += ["--concurrency", str(c), "--requests", str(n), "--warmup", "0"]
    cmd += ["--max-tokens", str(tokens), "--prompt-tokens", str(PROMPT_TOKENS)]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, text=True)
    lv = json.loads((out / "bench.json").read_text())["levels"][0]
    keys = ("output_tok_s", "ttft_ms_p50", "itl_ms_p50", "concurrency_mean", "errors")
    return {k: lv[k] for k in keys} | {
        "client_cpu_cores": lv["client_cpu"]["cores"],
        "window_s": lv["wall_s"],
    }


def run_guidellm(exe: str, url: str, model: str, c: int, n: int, data: Path, out: Path) -> dict:
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model={model}"]
    cmd += ["--profile", f"kind=concurrent,streams={c}"]
    cmd += ["--constraint", f"kind=max_requests,count={n}"]
    cmd += ["--data", f"kind=json_file,path={data}", "--disable-console"]
    cmd += ["--output", f"kind=json,path={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    sampler = CpuSampler(proc.pid)
    sampler.start()
    _, err = proc.communicate()
    sampler.stop.set()
    if proc.returncode:
        sys.exit(f"guidellm failed ({proc.returncode}): {err.decode()[-2000:]}")
    b = json.loads(out.read_text())["benchmarks"][0]
    m = b["metrics"]
    timings = [r["info"]["timings"] for r in b["requests"]["successful"]]
    busy = sum(t["request_end"] - t["request_start"] for t in timings)
    return {
        "output_tok_s": round(m["output_tokens_per_second"]["successful"]["mean"], 2),
        "ttft_ms_p50": round(m["time_to_first_token_ms"]["successful"]["median"], 2),
        "itl_ms_p50": round(m["inter_token_latency_ms"]["successful"]["median"], 2),
        "concurrency_mean": round(busy / b["duration"], 2),
        "errors": m["request_totals"]["errored"],
        # guidellm's processes over its window, sampled every 0.25 s (so +-0.25 s of CPU)
        "client_cpu_cores": round(
            sampler.between(b["start_time"], b["end_time"]) / b["duration"], 2
        ),
        "window_s": b["duration"],
    }


def mean_of(runs: list[dict]) -> dict:
    """One client's runs of a level as one record: the mean of each figure, and every tok/s."""
    out = {k: round(sum(r[k] for r in runs) / len(runs), 2) for k in runs[0]}
    return out | {"runs_tok_s": [r["output_tok_s"] for r in runs]}


def compare(a, server: str, pid: int, url: str, c: int, tokens: int, runs: Path) -> dict:
    """One level, both clients one after the other (ddserve first; with a.repeats 2 the
    order is ddserve, guidellm, guidellm, ddserve, so a drift of the server's speed over time
    falls on both): a row of crosscheck.json."""
    n = max(8, 4 * c) if tokens == TOKENS else 2 * c
    data = runs / f"prompts-{tokens}.jsonl"
    prompts = synthetic_prompts(PROMPT_TOKENS, max(64, n))  # what ddserve bench sends too
    data.write_text(
        "".join(json.dumps({"prompt": t, "output_tokens_count": tokens}) + "\n" for t in prompts)
    )
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    order = ["ddserve", "guidellm"] + (["guidellm", "ddserve"] if a.repeats == 2 else [])
    got: dict[str, list[dict]] = {"ddserve": [], "guidellm": []}
    for k, client in enumerate(order):
        name = f"{server}-c{c}-t{tokens}-{k}"
        cpu0 = cpu_seconds(pid)
        if client == "ddserve":
            r = run_ddserve(url, c, n, tokens, runs / f"ddserve-{name}")
        else:
            r = run_guidellm(a.guidellm, url, model, c, n, data, runs / f"guidellm-{name}.json")
        # the server idles outside the measured window: its CPU over the window
        r["server_cpu_cores"] = round((cpu_seconds(pid) - cpu0) / r.pop("window_s"), 3)
        # per request in flight: the server's speed as the client saw it, with the client's
        # own dead time between requests taken out
        r["tok_s_per_in_flight"] = round(r["output_tok_s"] / r["concurrency_mean"], 2)
        # per CPU second the server got: a CPU-bound server runs slower next to a client
        # that takes the cores it needs; this is its speed with that taken out
        r["tok_per_server_cpu_s"] = round(r["output_tok_s"] / max(r["server_cpu_cores"], 1e-3), 1)
        got[client].append(r)
    ours, theirs = mean_of(got["ddserve"]), mean_of(got["guidellm"])
    row = {"server": server, "concurrency": c, "output_tokens": tokens, "requests": n}
    row["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine
    row |= {"ddserve": ours, "guidellm": theirs}
    row["ratio"] = round(ours["output_tok_s"] / theirs["output_tok_s"], 3)
    row["ratio_per_in_flight"] = round(
        ours["tok_s_per_in_flight"] / theirs["tok_s_per_in_flight"], 3
    )
    row["ratio_per_server_cpu_s"] = round(
        ours["tok_per_server_cpu_s"] / theirs["tok_per_server_cpu_s"], 3
    )
    if server == "stub":
        row["ideal_tok_s"] = round(ideal(c, TTFT_MS, ITL_MS, tokens)["output_tok_s"], 2)
    print(
        f"{server:6s} C={c:<3d} {tokens:3d} tokens  ddserve {ours['runs_tok_s']}  "
        f"guidellm {theirs['runs_tok_s']}  ratio {row['ratio']:.3f} (per request in "
        f"flight {row['ratio_per_in_flight']:.3f}, per server CPU second "
        f"{row['ratio_per_server_cpu_s']:.3f})  ideal {row.get('ideal_tok_s', '-')}  "
        f"in flight {ours['concurrency_mean']} / {theirs['concurrency_mean']}  server CPU "
        f"{ours['server_cpu_cores']} / {theirs['server_cpu_cores']}  client CPU "
        f"{ours['client_cpu_cores']} / {theirs['client_cpu_cores']}  load {row['load_avg_1m']}",
        flush=True,
    )
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Stub: each client's tok/s as a share of the ideal; engine: as a share of ddserve's
    mean, every run a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    pairs = zip(axes[0], ("stub", "engine"), ("ideal", "ddserve mean"), strict=True)
    for ax, server, ref in pairs:
        sub = [r for r in rows if r["server"] == server]
        for k, client in enumerate(("ddserve", "guidellm")):
            for i, r in enumerate(sub):
                base = r["ideal_tok_s"] if server == "stub" else r["ddserve"]["output_tok_s"]
                runs = [t / base for t in r[client]["runs_tok_s"]]
                x = i + (k - 0.5) * 0.35
                ax.bar(
                    x, sum(runs) / len(runs), 0.35, color=f"C{k}", label=client if i == 0 else None
                )
                ax.plot([x] * len(runs), runs, "k.", ms=4)
        ax.axhline(1.0, color="grey", lw=0.8)
        labels = [f"C={r['concurrency']}\n{r['output_tokens']} tok" for r in sub]
        ax.set_xticks(range(len(sub)), labels)
        ax.set_ylabel(f"output tok/s / {ref}")
        ax.set_title(f"{server}", fontsize=10)
        if sub:
            ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("ddserve bench vs guidellm 0.8.1, same server, one after the other", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default="/work/venv-guidellm/bin/guidellm")
    p.add_argument("--levels", default="1,4,64")
    p.add_argument("--engine", action="store_true", help="also the tiny-random builtin engine")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        choices=[1, 2],
        help="2: each client twice per level, in the order ddserve, guidellm, guidellm, ddserve",
    )
    p.add_argument("--out", default="bench/results/crosscheck-cpu")
    p.add_argument(
        "--runs", default=None, help="keep every run's raw output here (default: a temp dir)"
    )
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # raw runs (guidellm's JSON holds every request: ~1 MB a run) stay out of --out
    runs = Path(a.runs or tempfile.mkdtemp(prefix="ddserve-crosscheck-"))
    runs.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in a.levels.split(",")]
    rows = []
    for server in ["stub"] + (["engine"] if a.engine else []):
        port = free_port()
        proc = start_server(server, port, runs / f"{server}.log")
        url = f"http://127.0.0.1:{port}"
        cases = [(c, TOKENS) for c in levels]
        if server == "stub":  # the top level again with requests 4x longer
            cases.append((levels[-1], LONG_TOKENS))
        else:  # a fresh engine's first requests are slow (allocations): not in any window
            run_ddserve(url, 4, 8, TOKENS, runs / "engine-warmup")
        try:
            for c, tokens in cases:
                rows.append(compare(a, server, proc.pid, url, c, tokens, runs))
        finally:
            proc.terminate()
            proc.wait(30)
    result = {
        "command": "python -m ddserve.bench.crosscheck " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPUs; other jobs share it (load_avg_1m per level)",
        "guidellm": subprocess.run(
            [a.guidellm, "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "stub": {"ttft_ms": TTFT_MS, "itl_ms": ITL_MS},
        "prompt_tokens": PROMPT_TOKENS,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": rows,
    }
    (out / "crosscheck.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "crosscheck.png")
    print(f"results: {out / 'crosscheck.json'} {out / 'crosscheck.png'}; raw runs: {runs}")


if __name__ == "__main__":
    main()
