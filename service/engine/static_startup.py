"""The static engine's start-up (ddserve.engine.static_engine, before it serves):

* warm-up: every graph the live parameters use, on inputs that touch only guard entries
* round times: real rounds of given budgets at every batch size of the graphs, on
  throw-away prompts (adaptive speculation's start-up cost model)
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import torch

from ddserve.config.engine import MAX_TOPK, LiveParams
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static import next_bucket
from ddserve.engine.static_models import FRESH_CTX, pack_target
from ddserve.engine.static_prefill import PREFILL_ROWS, bucket_sizes, fresh_rows

log = logging.getLogger(__name__)

# the start-up round times from calls of --num-scheduler-steps rounds, each a round's share
# (False: one round a call, as before 2026-12-07; benchmarks' switch, `bench.tuned`
# {"engine": {"ROUND_TIMES_TRIPS": false}})
ROUND_TIMES_TRIPS = True


class StartUp:
    """StaticEngine's start-up (a mixin: it reads the engine's pool, target, drafter and
    prefill chunks, and runs its prefill and rounds)."""

    @torch.inference_mode()
    def warm_up(self, params: LiveParams, contexts=(128, 256, 512), budgets=None) -> float:
        """Capture the graphs the current parameters use (every batch bucket, AR and tree
        widths, the prefill chunks; every context class with triton, the classes of
        `contexts` with sdpa) with inputs that touch only guard entries; `budgets`: every
        budget rounds may use (adaptive speculation), by default the live one. Other widths
        of verify and draft forwards (those of budgets set live, and with sdpa longer
        contexts) are captured on first use; prompt chunks of other shapes then run without
        graphs."""
        if not self.target.graphs.enabled:
            return 0.0
        t0 = time.perf_counter()
        ml = self.pool.max_len
        budgets = sorted(set(budgets or [params.budget]))
        ctxs = self.target.classes(contexts)
        if isinstance(self.drafter, NoDrafter):  # AR: every round verifies the roots alone
            widths = [1]
        else:
            widths = {1} | {self.tree_width(b, params.topk)[0] for b in budgets}
            if not self.device_tree:  # trees built on the host: any power of two up to it
                widths |= set(bucket_sizes(max(widths)))
            widths = sorted(widths)
        for b in bucket_sizes(self.pool.slots):
            for w in widths:
                for ctx in ctxs:
                    if ctx < w:
                        continue
                    guard = np.tile(np.arange(ml - w, ml), (b, 1))
                    tree = np.tile(np.eye(w, dtype=bool), (b, 1, 1))
                    zeros = np.zeros((b, w), dtype=np.int64)
                    packed = pack_target(
                        zeros, zeros, guard, np.zeros(b, np.int64), np.arange(b), tree
                    )
                    self.target.forward(packed, b, w, ctx, True)
        # every prompt chunk shape (with sdpa, of the short classes: longer chunks run
        # without graphs)
        for b in bucket_sizes(PREFILL_ROWS):
            for w in self.chunks:
                for ctx in ctxs:
                    if ctx >= w:
                        self._guard_chunk(b, w, ctx)
        # a prompt's first chunk (its rows start at an empty context: the fresh class)
        for w in self.fresh_chunks:
            for b in bucket_sizes(fresh_rows(w)):
                self._guard_chunk(b, w, FRESH_CTX)
        # from now on a prompt chunk of a shape not captured runs without a graph and
        # uncompiled (a capture or a recompilation while others decode would stall them);
        # one such chunk now (the fused attention kernels' first-use set-up)
        self.target.capture_prefill = False
        w = self.chunks[0] + 1
        self._guard_chunk(1, w, self.target.ctx_bucket(w))
        if self.sdraft is not None:  # context-only rounds (budget 0)
            wn = self.sdraft.rows
            for b in bucket_sizes(self.pool.slots):
                self.sdraft.write_only(np.tile(np.arange(ml - wn, ml), (b, 1)))
            self.sdraft.warm_up_catch_up()  # prompts' context rows, every size
        keys = set()  # the draft graphs' keys but batch size and context
        for budget in budgets if self.sdraft is not None else ():
            depth = self.block_depth(budget)
            if depth > 0 and self.device_tree:
                keys.add((depth, params.topk, budget, self.tree_width(budget, params.topk)[0]))
            elif depth > 0:
                keys.add((depth, next_bucket(params.topk, 1, MAX_TOPK)))
        for depth, *rest in sorted(keys):
            for b in bucket_sizes(self.pool.slots):
                for ctx in ctxs:
                    packed = self.sdraft.guard_inputs(b, depth)
                    drafted = self.sdraft.forward(packed, (b, depth, ctx, *rest))
                    if self.device_tree and self.scheduler_steps > 1:  # rounds a trip
                        self.spec_warm_up(drafted, (b, depth, ctx, *rest), ctxs, params.window)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def round_times(
        self, params: LiveParams, budgets: list[int], rounds: int = 3, prompt_tokens: int = 16
    ) -> dict[tuple[int, int], float]:
        """{(batch, budget): seconds}: the median wall time of a round in `rounds` real calls
        (after an untimed one) of `batch` throw-away greedy requests at each budget, fresh
        ones for each (every budget at the same short context), for every batch size the
        graphs are captured for; draft, verify, accept and the host's work included. A call
        takes the engine's --num-scheduler-steps, as a running engine's do, and its time per
        round is the call's over the rounds it ran, as the adaptive policy's live samples
        are (measured one round a call, every candidate but the one in use carried a whole
        host round trip a round, so the policy leaned to the budget its first rounds made
        live: likely why, at 16 requests on an H100, it kept the ceiling b15 where fixed b7
        made more tokens a second, bench/NOTES.md). Their KV slots are free again
        after. A failure (out of memory at the largest shapes, say) ends the measurement
        there: what was measured before it is returned. Nothing if a slot cannot hold the
        rounds."""
        rows = 1 + rounds
        room = self.pool.usable - prompt_tokens  # entries a slot has for the calls' rounds
        per_round = rows * (max(budgets) + 1)
        if per_round > room:
            return {}
        steps = self.scheduler_steps if ROUND_TIMES_TRIPS else 1
        if steps * per_round > room:
            steps = 1  # a short pool: one round a call
        prompt = [self.model.cfg.bos_token_id or 0] * prompt_tokens
        sampling = SamplingParams(max_tokens=self.pool.usable, ignore_eos=True)
        out = {}
        for batch in bucket_sizes(self.pool.slots):
            for budget in budgets:
                if self.pool.free < batch:  # slots taken by requests: not the time to measure
                    return out
                seqs = []
                try:
                    for _ in range(batch):  # each one kept as it is made: all are released
                        seqs.append(self.new_sequence(prompt, sampling))
                    self.prefill_batch(seqs)
                    p = params.model_copy(update={"budget": budget})
                    times = []
                    for i in range(rows):
                        t0 = time.perf_counter()
                        for new in self.step_batch(seqs, p, steps=steps):
                            if isinstance(new, Exception):
                                raise new
                        if i:
                            times.append((time.perf_counter() - t0) / self.round_steps)
                    out[(batch, budget)] = statistics.median(times)
                except Exception as exc:  # noqa: BLE001 - a measurement, never the start
                    log.warning(
                        "round times: stopped at %d requests, budget %d: %s", batch, budget, exc
                    )
                    return out
                finally:
                    for seq in seqs:
                        self.release(seq)
        return out
