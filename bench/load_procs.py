"""The load client spread over several processes (`ddserve bench --client-procs N`).

Each process runs C/N of the level's workers (the remainder to the first ones) on its own
event loop. All take request numbers from one shared counter per phase, a barrier starts the
measured phase in every process at once, and each sends its measured results and its CPU
back through a pipe; the parent merges them into one level (ddserve.bench.load.summarize).
Processes are spawned, not forked: the parent may hold threads (a tokenizer's, tqdm's).
"""

from __future__ import annotations

import multiprocessing as mp

from ddserve.bench.load import (
    RequestSpec,
    Tickets,
    closed_loop,
    phases,
    run_loop,
    sender,
    summarize,
)
from ddserve.errors import OperationFailed


def split(concurrency: int, procs: int) -> list[int]:
    """C workers over N processes: C // N each, the remainder to the first ones."""
    return [concurrency // procs + (k < concurrency % procs) for k in range(procs)]


def _client_proc(spec, workers, warmup, requests, shared, barrier, done, out) -> None:
    """A client process: its workers' share of both phases; results back through `out`."""

    def tick():
        with done.get_lock():
            done.value += 1

    async def go():
        async with sender(spec, workers) as send:
            return await phases(
                send,
                workers,
                Tickets(warmup, shared[0]),
                Tickets(requests, shared[1]),
                warmup,
                tick,
                barrier,
            )

    try:
        out.send(run_loop(go()))
    except Exception as exc:  # noqa: BLE001 - reported by the parent as one line
        barrier.abort()
        out.send(f"{type(exc).__name__}: {exc}")
    finally:
        out.close()


def run_procs(
    spec: RequestSpec, concurrency: int, requests: int, warmup: int, procs: int, on_done=None
) -> dict:
    """The level over `procs` spawned processes; progress through a shared counter."""
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
    shared = (ctx.Value("q", 0), ctx.Value("q", 0))
    done = ctx.Value("q", 0)
    barrier = ctx.Barrier(procs)
    children, pipes = [], []
    for workers in split(concurrency, procs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_client_proc,
            args=(spec, workers, warmup, requests, shared, barrier, done, send),
            daemon=True,
        )
        p.start()
        send.close()
        children.append(p)
        pipes.append(recv)
    answers: list = [None] * procs
    seen = 0
    try:
        while any(a is None for a in answers):
            for k, pipe in enumerate(pipes):
                if answers[k] is None and pipe.poll(0.1):
                    try:
                        answers[k] = pipe.recv()
                    except EOFError:
                        children[k].join(5)
                        answers[k] = f"exited with code {children[k].exitcode}"
                        barrier.abort()
            if on_done:
                for _ in range(done.value - seen):
                    on_done()
                seen = done.value
    finally:
        for p in children:
            p.join(5)
            if p.is_alive():
                p.terminate()
    failed = [f"process {k}: {a}" for k, a in enumerate(answers) if isinstance(a, str)]
    if failed:
        raise OperationFailed(f"load client failed: {failed[0]}")
    results = [r for rs, _ in answers for r in rs]
    return summarize(results, concurrency, [cpu for _, cpu in answers])


def run_level(
    spec: RequestSpec,
    concurrency: int,
    requests: int,
    warmup: int,
    procs: int = 1,
    on_done=None,
) -> dict:
    """One level over HTTP: in this process (procs=1), or spread over `procs` processes."""
    procs = max(1, min(procs, concurrency))
    if procs > 1:
        return run_procs(spec, concurrency, requests, warmup, procs, on_done)

    async def go():
        async with sender(spec, concurrency) as send:
            return await closed_loop(send, concurrency, requests, warmup, on_done)

    return run_loop(go())
