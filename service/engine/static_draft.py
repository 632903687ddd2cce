"""The draft step of the static engine's round (ddserve.engine.static_engine): each
sequence's tree for the verify.

  * DFlash: one batched forward over the drafter's pool writes the newly committed tokens'
    context entries and drafts every row's block; the trees are built on the GPU
    (ddserve.engine.tree_triton) and stay there for the verify, or on the host from the
    copied top-k (`build_tree_top`)
  * budget 0 with DFlash: no draft; the context write waits until a slot's feature rows are
    full (they hold one round's root + accepted path, or many budget-0 roots:
    static_dflash.BUFFERED_ROWS) or a draft comes whose context write would not take them
  * other drafters draft on their own (`draft`: per-depth log-probs), trees on the host
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ddserve.config.engine import MAX_TOPK, LiveParams
from ddserve.engine.drafters import DraftContext
from ddserve.engine.sequence import Sequence
from ddserve.engine.static import next_bucket
from ddserve.engine.static_dflash import pack_draft
from ddserve.engine.tree import DeviceTrees, Tree, build_tree, build_tree_top, size_bound
from ddserve.errors import EngineError


class Drafting:
    """StaticEngine's draft step (a mixin: it reads the engine's pool, target, drafter,
    DFlash state and timing)."""

    def draft(self, seq: Sequence, params: LiveParams) -> torch.Tensor | None:
        """Per-depth log-probs [L, V] from a drafter that drafts on its own (not DFlash)."""
        depth = self.block_depth(params.budget)
        if depth <= 0:
            return None
        return self.drafter.draft(seq.draft_state, DraftContext(seq.tokens, params.window), depth)

    def block_depth(self, budget: int) -> int:
        """Positions a round of `budget` drafts: a DFlash drafter drafts its whole trained
        block (up to the engine's depth) whatever the budget, since its attention inside the
        block is bidirectional and it learnt blocks of that size: a block cut to the budget
        drafts worse (b3/k1 on the held-out answers, simulated: tau 2.239 from 3-position
        blocks, 2.286 from the first 3 of 8; bench/NOTES.md); the tree still has at most
        `budget` nodes. Other drafters draft `budget` deep at most."""
        if budget <= 0:
            return 0
        if self.sdraft is not None:
            return min(self.depth, self.sdraft.block)
        return min(self.depth, budget)

    def tree_width(self, budget: int, topk: int, depth: int | None = None) -> tuple[int, int]:
        """(verify width, most nodes + 1) of the trees a round of these parameters builds."""
        if depth is None:
            depth = self.block_depth(budget)
        bound = size_bound(budget, depth, topk) + 1
        return next_bucket(bound, 1, 1 << 30), bound

    def _draft_trees(
        self, seqs: list[Sequence], params: LiveParams, reach: int = 0
    ) -> list[Tree] | DeviceTrees:
        """Every sequence's tree of this round; `reach`: positions the context may grow by
        before this shape drafts again (rounds back to back on the device, static_spec)."""
        t0 = time.perf_counter()
        depth = self.block_depth(params.budget)
        if self.sdraft is None or depth <= 0:
            # budget 0: the drafter's context write waits until a sequence's feature rows
            # would not hold another round's root (or the next draft writes them)
            self._write_pending(seqs, 1)
            trees = [
                build_tree(seq.tokens[-1], self.draft(seq, params), params.budget, params.topk)
                for seq in seqs
            ]
            self.timing["draft_s"] += time.perf_counter() - t0
            return trees
        sd = self.sdraft
        self._write_pending(seqs, 0, sd.new_rows)  # budget-0 rows the draft would not take
        b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
        q, ml = depth + 1, self.pool.max_len
        slots, root_pos = self._rows(seqs)  # root_pos: the context once fed
        cwpos, fed = self._feed_context(seqs, b, slots, root_pos, sd.new_rows)
        root = np.zeros(b, dtype=np.int64)
        bwpos = np.tile(np.arange(ml - q, ml), (b, 1))
        bpos = np.zeros((b, q), dtype=np.int64)
        lens = np.zeros(b, dtype=np.int64)
        window = np.full(b, ml, dtype=np.int64)
        root[slots] = [seq.tokens[-1] for seq in seqs]
        bwpos[slots] = bpos[slots] = root_pos[:, None] + np.arange(q)
        lens[slots], window[slots] = root_pos, params.window
        packed = pack_draft(cwpos, root, bwpos, bpos, lens, window)
        ctx = self.target.ctx_bucket(int(root_pos.max()) + q + reach)
        if self.device_tree:  # the trees on the GPU, left there for the verify
            width, bound = self.tree_width(params.budget, params.topk, depth)
            key = (b, depth, ctx, params.topk, params.budget, width)
            out = sd.forward(packed, key)
            self._fed(fed)
            self.timing["draft_s"] += time.perf_counter() - t0
            return DeviceTrees(*out, width, bound)
        key = (b, depth, ctx, next_bucket(params.topk, 1, MAX_TOPK))
        top = sd.forward(packed, key)
        self._fed(fed)
        top = top.cpu().numpy()
        t1 = time.perf_counter()
        trees = []
        k = params.topk
        for seq in seqs:
            s = seq.cache.slot
            lp, ids = top[0, s, :, :k], top[1, s, :, :k].astype(np.int64)
            trees.append(build_tree_top(seq.tokens[-1], lp.tolist(), ids.tolist(), params.budget))
        self.timing["draft_s"] += t1 - t0
        self.timing["tree_s"] += time.perf_counter() - t1
        return trees

    def _write_pending(self, seqs: list[Sequence], rows: int, limit: int | None = None) -> None:
        """Budget-0 rounds defer the drafter's context write: write every sequence's
        pending feature rows where one's would not hold `rows` more within `limit` (the
        buffer's rows; a draft's context write, before a draft)."""
        sd = self.sdraft
        limit = sd.rows if sd is not None and limit is None else limit
        if sd is not None and any(seq.pending + rows > limit for seq in seqs):
            b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
            cwpos, fed = self._feed_context(seqs, b, *self._rows(seqs), sd.rows)
            sd.write_only(cwpos)
            self._fed(fed)

    def _feed_context(self, seqs: list[Sequence], b: int, slots, want, wn: int):
        """Where each sequence's pending feature rows go in the drafter's pool (context write
        positions [B, wn], unused rows to the guard entries), and each one's context
        length once they are written: `_fed` records it after the write is queued, so a draft
        that raises leaves the rows pending for the retry. `slots`, `want`: `_rows(seqs)`."""
        ml = self.pool.max_len
        self._catch_up([seq for seq in seqs if seq.hidden_new])
        start = np.fromiter((seq.draft_state for seq in seqs), np.int64, len(seqs))
        fed = start + np.fromiter((seq.pending for seq in seqs), np.int64, len(seqs))
        if (bad := np.flatnonzero(fed != want)).size:
            i = bad[0]
            raise EngineError(f"DFlash context covers {fed[i]} tokens, expected {want[i]}")
        if (over := np.flatnonzero(fed - start > wn)).size:  # never dropped silently
            i = over[0]
            raise EngineError(f"{fed[i] - start[i]} DFlash feature rows pending, at most {wn}")
        j = np.arange(wn)
        cwpos = np.tile(np.arange(ml - wn, ml), (b, 1))
        cwpos[slots] = np.where(j < (fed - start)[:, None], start[:, None] + j, cwpos[slots])
        return cwpos, list(zip(seqs, fed.tolist(), strict=True))

    @staticmethod
    def _rows(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's KV slot and the length of its committed context but the last token
        (the root of its next tree), as arrays in `seqs` order."""
        n = len(seqs)
        return (
            np.fromiter((seq.cache.slot for seq in seqs), np.int64, n),
            np.fromiter((len(seq.tokens) - 1 for seq in seqs), np.int64, n),
        )

    @staticmethod
    def _fed(fed) -> None:
        for seq, length in fed:
            seq.draft_state, seq.pending = length, 0

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Prompts' context rows (more than one round's), written after prefill: every
        newcomer of the round in one write (`StaticDFlash.extend_many`)."""
        if not seqs:
            return
        taps = [
            seq.hidden_new[0] if len(seq.hidden_new) == 1 else torch.cat(seq.hidden_new)
            for seq in seqs
        ]
        slots, starts = [seq.cache.slot for seq in seqs], [seq.draft_state for seq in seqs]
        self.sdraft.extend_many(slots, starts, taps)
        for seq, t in zip(seqs, taps, strict=True):  # written: a write that raised kept them
            seq.hidden_new.clear()
            seq.draft_state += t.shape[0]
