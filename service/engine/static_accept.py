"""The accept step of the static engine's round (ddserve.engine.static_engine), for the whole
batch at once once the verify's one copy is on the host:

  * every request's accepted path and bonus token (`tree.accept_batch`: a depth at a time
    over the batch's [N, W] arrays of tokens, parents and the target's choices), and a
    failure of its own where its rows hold non-finite logits or no drawable distribution
  * the moves the paths imply, as one index array for one host-to-device copy: accepted
    entries to their places in the KV pool, and the drafter feature rows they feed

At 64 requests on the H200 this per-request Python (Tree objects from the GPU trees, a walk
and a move list each) cost ~1.4 ms a round, a third of a b7/k4 round (bench/NOTES.md).
"""

from __future__ import annotations

import numpy as np

from ddserve.engine.sequence import Sequence
from ddserve.engine.tree import WALK_ROWS, accept_batch
from ddserve.errors import EngineError

Decision = tuple[list[int], list[int], int]  # accepted nodes, their tokens, the bonus token
# what ends a request whose rows went wrong (here and in multi-step rounds, static_steps)
NON_FINITE = "the target produced non-finite logits (broken weights?)"
NO_DISTRIBUTION = (
    "sampling found no finite distribution at this request's temperature, top_p and top_k"
)


class Accepting:
    """StaticEngine's accept step (a mixin: it reads the engine's drafter pool)."""

    accept_batch = staticmethod(accept_batch)  # the accept rule (ddserve.engine.tree); a seam

    def _decide(self, seqs: list[Sequence], top, tokens, par, rows, w: int):
        """Each sequence's (path, path tokens, bonus), or the exception that ends it alone,
        from the verify's copy `top` [rows, B*W] and the trees' `tokens`/`par` [B, W] (parent
        -2 past a tree); `rows` the sequences' slots. Returns (decisions, paths, lengths,
        tree sizes): paths/lengths as `accept_batch` gives them, sizes (root included) a list."""
        b = tokens.shape[0]
        parents = par[rows]
        nodes = parents != -2  # a tree's own nodes (its rows), not the padding after them
        targets = top[0].reshape(b, w)[rows]
        if nodes[:, 1:].any():
            paths, lengths, bonus, ptoks = self.accept_batch(tokens[rows], parents, targets)
        else:  # roots alone (autoregressive rounds): every path empty, the bonus the target's
            paths = ptoks = np.zeros((len(seqs), 0), np.int64)
            lengths, bonus = np.zeros(len(seqs), np.int64), targets[:, 0]
        failed = {}  # index in seqs -> what ended it; a request's own rows only where some failed
        if not top[1].all():
            for i in np.flatnonzero(~(top[1].reshape(b, w)[rows].astype(bool) | ~nodes).all(1)):
                failed[int(i)] = EngineError(NON_FINITE)
        if top.shape[0] >= 3 and not top[2].all():
            for i in np.flatnonzero(~(top[2].reshape(b, w)[rows].astype(bool) | ~nodes).all(1)):
                if int(i) not in failed and not seqs[i].sampling.greedy:
                    failed[int(i)] = EngineError(NO_DISTRIBUTION)
        decided: list[Decision | Exception] = []
        for i, (p, n, pt, bt) in enumerate(
            zip(paths.tolist(), lengths.tolist(), ptoks.tolist(), bonus.tolist(), strict=True)
        ):
            decided.append(failed[i] if i in failed else (p[:n], pt[:n], bt))
        return decided, paths, lengths, nodes.sum(axis=1).tolist()

    def _move_index(self, seqs, decided, paths, lengths, starts, rows, w: int):
        """The round's moves as one index array: entry start + j of a slot takes entry
        start + keep[j] (keep = root, then the accepted path's nodes) -- (slots, to, from)
        of the n entries that move -- then the m drafter feature rows the root and path feed
        (to, from: after the rows still waiting to be written; budget-0 rounds defer the
        write). Sequences whose decision is an exception move nothing. Returns (index, n, m)."""
        sd = self.sdraft
        if sd is None and not lengths.any():  # no path anywhere: nothing moves
            return np.zeros(0, np.int64), 0, 0
        if len(seqs) <= WALK_ROWS:  # a few: lists (numpy's per-call cost would dominate)
            moves, src, dst = ([], [], []), [], []
            for seq, d in zip(seqs, decided, strict=True):
                if isinstance(d, Exception):
                    continue
                keep = [0, *d[0]]
                n0, slot = seq.cache.length, seq.cache.slot
                for j, i in enumerate(keep):
                    if i != j:
                        moves[0].append(slot)
                        moves[1].append(n0 + j)
                        moves[2].append(n0 + i)
                if sd is not None:
                    src += [slot * w + i for i in keep]
                    at = slot * sd.rows + seq.pending
                    dst += [at + j for j in range(len(keep))]
            idx = np.array([*moves[0], *moves[1], *moves[2], *dst, *src], np.int64)
            return idx, len(moves[0]), len(dst)
        ok = np.array([not isinstance(d, Exception) for d in decided])
        keep = np.concatenate([np.zeros((len(seqs), 1), np.int64), paths], axis=1)
        j = np.arange(keep.shape[1])
        kept = (j <= lengths[:, None]) & ok[:, None]
        moved = kept & (keep != j)
        parts = [
            np.broadcast_to(rows[:, None], keep.shape)[moved],
            (starts[:, None] + j)[moved],
            (starts[:, None] + keep)[moved],
        ]
        if sd is not None:
            pending = np.fromiter((seq.pending for seq in seqs), np.int64, len(seqs))
            at = rows * sd.rows + pending
            parts += [(at[:, None] + j)[kept], (rows[:, None] * w + keep)[kept]]
        m = int(kept.sum()) if sd is not None else 0
        return np.concatenate(parts), int(moved.sum()), m
