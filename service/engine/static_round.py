"""One round of the static engine (ddserve.engine.static_engine) for every sequence of a batch:
draft and build each tree (ddserve.engine.static_draft), verify all trees in one fixed-shape
target forward, then decide each sequence's path (ddserve.engine.static_accept), move the
accepted entries in the pool and commit per sequence. Its one device->host copy brings the
verify's choices (argmax, a biased request's argmax, each sampled request's draws) and, for
trees built on the GPU, the trees; raw log-probs come from the verify's own logits for the
requests that ask."""

from __future__ import annotations

import time

import numpy as np
import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.sampling import SampleGroup, gather_logprobs
from ddserve.engine.sequence import Outcome, Sequence, truncate_at_stop
from ddserve.engine.static import next_bucket
from ddserve.engine.static_models import pack_target
from ddserve.engine.tree import DeviceTrees, ancestor_mask


class OneRound:
    """StaticEngine's one-round path (a mixin: it reads the engine's pool, target, drafter,
    sampler and timing)."""

    def _one_round(self, seqs: list[Sequence], params: LiveParams) -> list[Outcome]:
        """One round of every sequence (see StaticEngine.step_batch)."""
        self.round_steps = 1
        t0 = time.perf_counter()
        drafted = self._draft_trees(seqs, params)
        t1 = time.perf_counter()
        on_device = isinstance(drafted, DeviceTrees)
        b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
        if on_device:  # built on the GPU: only their sizes' bound is known here
            w, sizes = drafted.width, [drafted.bound] * len(seqs)
        else:
            sizes = [t.size for t in drafted]
            w = next_bucket(max(sizes), 1, 1 << 30)
        tokens = np.zeros((b, w), dtype=np.int64)
        pos = np.zeros((b, w), dtype=np.int64)
        wpos = np.tile(np.arange(self.pool.max_len - w, self.pool.max_len), (b, 1))
        lens = np.zeros(b, dtype=np.int64)
        tree_m = None if on_device else np.tile(np.eye(w, dtype=bool), (b, 1, 1))
        if not on_device:  # the trees' parents for the walk (the root's: -1; padding: -2)
            par = np.full((b, w), -2, dtype=np.int64)
            par[:, 0] = -1
        slots = [seq.cache.slot for seq in seqs]
        starts = np.array([seq.cache.length for seq in seqs], dtype=np.int64)
        wpos[slots] = starts[:, None] + np.arange(w)
        lens[slots] = starts
        longest = int(starts.max()) + w
        if not on_device:
            for slot, n0, tree in zip(slots, starts.tolist(), drafted, strict=True):
                if tree.size == 1:  # the root alone (plain decoding): the eye's row, depth 0
                    tokens[slot, 0], pos[slot, 0] = tree.tokens[0], n0
                    continue
                tokens[slot, : tree.size] = tree.tokens
                par[slot, : tree.size] = tree.parents
                pos[slot, : tree.size] = n0 + np.asarray(tree.depths)
                tree_m[slot] = ancestor_mask(tree, w)
        for seq, n in zip(seqs, sizes, strict=True):
            seq.cache.reserve(n)
        ctx = self.target.ctx_bucket(longest)
        # trees from the GPU bring their own mask (the packed inputs stop before it)
        packed = pack_target(tokens, pos, wpos, lens, np.arange(b), None if on_device else tree_m)
        t2 = time.perf_counter()
        dev_trees = (drafted.tokens, drafted.positions, drafted.mask) if on_device else None
        logits, top, taps = self.target.forward(packed, b, w, ctx, True, dev_trees)
        biased_greedy = [
            (seq.cache.slot * w, n, seq.bias)
            for seq, n in zip(seqs, sizes, strict=True)
            if seq.bias is not None and seq.sampling.greedy
        ]
        if biased_greedy:  # their argmax under the bias, into the same copy
            top = top.clone()
            for r0, n, bias in biased_greedy:
                top[0, r0 : r0 + n] = (logits[r0 : r0 + n] + bias).argmax(-1)
        sampled = [  # the rows of its own tree (or the bound of GPU trees), not the width:
            # how many numbers a request draws never depends on who shares its round
            SampleGroup(seq.cache.slot * w, n, seq.sampling, seq.bias, seq.generator)
            for seq, n in zip(seqs, sizes, strict=True)
            if not seq.sampling.greedy
        ]
        if sampled:  # their samples too, all at once, into the same copy (+ a row: sampled ok)
            top = self.sampler.into(top, logits, sampled)
        if on_device:  # the trees come back with the verify's argmax: still one sync
            both = torch.cat([top, *drafted.for_host(b * w)]).cpu().numpy()
            top, k = both[: top.shape[0]], top.shape[0]
            tokens, par = both[k].reshape(b, w), both[k + 1].reshape(b, w)
            if self.on_trees is not None:
                self.on_trees([drafted.tree(both[k:], slot * w, w) for slot in slots])
        else:
            top = top.cpu().numpy()  # the one sync of the verify
            if self.on_trees is not None:
                self.on_trees(drafted)
        t3 = time.perf_counter()
        # every sequence's path at once (no state changes: a failure here is its own)
        rows = np.asarray(slots)
        decided, paths, lengths, sizes = self._decide(seqs, top, tokens, par, rows, w)
        # raw log-probs of the tokens each path emits, read at the rows they were chosen at
        # (root + accepted nodes), for the requests that ask; shared, so before any commit
        asking = [
            (seq, d)
            for seq, d in zip(seqs, decided, strict=True)
            if seq.logprobs is not None and not isinstance(d, Exception)
        ]
        round_logprobs = {}
        if asking:
            groups = []
            for seq, (path, pt, bt) in asking:
                r0 = seq.cache.slot * w
                groups.append(([r0 + i for i in (0, *path)], pt + [bt], seq.sampling.logprobs))
            for (seq, _), lp in zip(asking, gather_logprobs(logits, groups), strict=True):
                round_logprobs[id(seq)] = lp
        # move the accepted paths' KV (and drafter features) for the whole batch; this
        # writes only pending entries, so if it fails nothing committed has changed
        idx, n, m = self._move_index(seqs, decided, paths, lengths, starts, rows, w)
        if n:  # the pool's rows of the moving entries (every KV head), then the features'
            pool, (slots_, to, frm) = self.pool, (idx[i * n : (i + 1) * n] for i in range(3))
            idx = np.concatenate(
                [pool.entries(slots_, to), pool.entries(slots_, frm), idx[3 * n :]]
            )
            n *= pool.kv_heads
        if n or m:  # every index of the moves in one host->device copy
            idx = torch.from_numpy(idx).to(self.pool.kv.device)
        if n:
            self.pool.move_entries(idx[:n], idx[n : 2 * n])
        if m:  # copied out now: the next forward of this shape overwrites `taps`
            feats = self.sdraft.feats.flatten(0, 1)
            at = 2 * n
            feats.index_copy_(0, idx[at : at + m], taps.index_select(0, idx[at + m :]))
        # commit: host state only
        out: list[Outcome] = []
        for seq, d in zip(seqs, decided, strict=True):
            if isinstance(d, Exception):
                seq.finish_reason = "error"
                out.append(d)
                continue
            path, ptoks, bt = d
            seq.last_paths = [path]
            seq.cache.length += len(path) + 1
            if self.sdraft is not None:
                seq.pending += len(path) + 1
            new = ptoks + [bt]
            new = truncate_at_stop(seq, new, self.eos_token_ids)
            seq.tokens.extend(new)
            seq.output.extend(new)
            if seq.logprobs is not None:
                seq.logprobs.extend(round_logprobs[id(seq)].slice(0, len(new)))
            out.append(new)
        t4 = time.perf_counter()
        tm = self.timing
        tm["rounds"] += 1
        tm["trips"] += 1
        tm["verify_s"] += t3 - t2
        tm["accept_s"] += t4 - t3 + t2 - t1
        for seq, new, size in zip(seqs, out, sizes, strict=True):
            if isinstance(new, Exception):
                continue
            st = seq.stats
            st.draft_tokens += size - 1
            st.draft_s += (t1 - t0) / len(seqs)
            st.verify_s += t4 - t1
            st.verify_rounds += 1
            st.completion_tokens += len(new)
            st.accept_lengths.append(len(new))
        return out
