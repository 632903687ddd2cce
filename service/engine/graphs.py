"""CUDA graphs per shape key for the static engine's forwards (ddserve.engine.static): captured
on first use or at warm-up, replayed after; graphs of one lane share a memory pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


# GraphCache's second warm-up run on the capture stream (`_capture`); False: both on the
# warm-up stream, as before 2026-12-07 (benchmarks' switch, bench.tuned's engine knobs: the
# defect it mends, side by side)
CAPTURE_STREAM_WARM_UP = True


class Lane(NamedTuple):
    """What a GraphCache's graphs of one lane share."""

    pool: object  # torch.cuda.graph_pool_handle()
    capture: torch.cuda.Stream
    warm_up: torch.cuda.Stream


class GraphCache:
    """CUDA graphs of `fn(key)` per shape key, those of one lane sharing one memory pool. `fn`
    reads its inputs from buffers that stay put and returns its outputs; a replay refreshes
    them in place.
    Every tensor `fn` reads must outlive the graph: one made outside it and dropped after the
    capture is freed memory at replay (make such index tensors inside `fn`).
    Off (or on CPU) it just calls `fn`. A capture that fails turns graphs off for good (logged):
    the engine stays correct, only slower.
    Lanes: graphs of different lanes may replay at the same time on different streams (a
    prompt chunk beside a decode step, StaticEngine's overlapped prefill), so each lane has
    its own memory pool, its own capture stream (cuBLAS keeps a workspace per stream that a
    captured GEMM reuses at every replay: graphs captured on one stream share it) and its own
    stream for the first warm-up run before a capture (the second runs on the capture stream,
    eagerly: `_capture`). All are drawn here, once: torch hands out
    streams round-robin from a pool of 32, so a stream drawn per capture would sooner or
    later be another lane's."""

    def __init__(self, enabled: bool, name: str, lanes: int = 1):
        self.enabled = enabled and torch.cuda.is_available()
        self.name = name
        self.graphs: dict = {}
        self.lanes: list[Lane] = []
        if self.enabled:
            self.lanes = [
                Lane(torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.Stream())
                for _ in range(lanes)
            ]

    def run(self, key, fn: Callable[[], object], lane: int = 0):
        if not self.enabled:
            return fn()
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, fn, lane)
            except Exception as exc:  # noqa: BLE001 - any capture failure: fall back to eager
                log.warning(
                    "%s: CUDA graph capture of %s failed, running eagerly: %s", self.name, key, exc
                )
                self.enabled = False
                torch.cuda.synchronize()
                return fn()
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, key, fn, lane: int):
        pool, capture, stream = self.lanes[lane]  # its first warm-up run goes to `stream`
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs (allocator, cuBLAS handles) off-graph
            fn()
        # the second on the capture stream, eagerly: what a forward makes once per stream and
        # keeps (the split-K kernels' workspace and tile counters, ddserve.engine.layer_split)
        # is then made here, in the general pool. Made inside the capture it would come from
        # the lane's shared graph pool, where it may overlap memory that a graph captured
        # earlier uses as scratch: that graph's every replay would overwrite it (PyTorch
        # shares a pool safely only among graphs replayed in capture order; these replay in
        # any order). The counters must stay zero between kernels: overwritten, a split tile
        # was finished by the wrong program or never, and the H100's adaptive rounds, whose
        # widths change round by round, ended requests with non-finite logits.
        second = capture if CAPTURE_STREAM_WARM_UP else stream
        second.wait_stream(stream)
        with torch.cuda.stream(second):
            fn()
        torch.cuda.current_stream().wait_stream(second)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture):
            out = fn()
        return graph, out
