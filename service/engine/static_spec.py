"""Several DDTree rounds a host round trip (`--num-scheduler-steps N` with a DFlash drafter
whose trees the GPU builds): the host's part of a round -- reading the verify back, the
accept walk, the moves it implies, packing the next draft -- done on the device, so N rounds
of the static engine (ddserve.engine.static_engine) run back to back and their tokens come
back in one copy. SGLang's overlap scheduler hides the same host time behind the next
round; here there is none to hide.

At one request on an H100 a b15/k4 round took 1.51 ms, 0.40 of them with the GPU idle while
the host read the round back and packed the next (bench/NOTES.md). Here each round, after
the first round's draft (packed on the host as always):
  * the verify's inputs from the trees and each row's committed length (`fill_verify`)
  * the target's choices into one buffer: its argmax, the argmax under a request's logit
    bias, each sampled request's draws (on the device, with its own generator)
  * `round_glue`: the accept (tree.accept_device: the path and bonus of the host's walk),
    the path's KV entries to their places, its drafter feature rows copied, the next
    draft's inputs written, the round's record kept
both of those in a CUDA graph per shape (pure functions of their inputs: a capture's
warm-up runs change nothing), the KV move and two copies outside. The same trees, verify,
accept rule and draws as one-round rounds: lossless alike.

What N rounds cost instead (as static_steps'): tokens arrive N rounds at a time; a request
that ends inside them pays the rest (their tokens dropped, their entries past its end never
read; the rounds are sized to the longest answer's token limit at its recent accept length);
the runner takes one round while prompts wait or a request awaits its first token (unless
--first-token-share lets it wait for the trip); requests
that want log-probs and trees built on the host take one round (budget-0 calls take plain
steps: ddserve.engine.static_steps); the live parameters are read once for the N rounds. A
round with non-finite logits (or no drawable distribution) before a request's stop ends it
after the rounds before it (their tokens committed and delivered before the error)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.sampling import SampleGroup, sample_rows
from ddserve.engine.sequence import Outcome, Sequence, ended_after, truncate_at_stop
from ddserve.engine.static_accept import NO_DISTRIBUTION, NON_FINITE
from ddserve.engine.static_models import glue_compiled
from ddserve.engine.tree import DeviceTrees, accept_device
from ddserve.errors import EngineError

# whether the rounds' glue (fill_verify, round_glue) goes through torch.compile where the
# engine compiles (a GPU): its ~50 small kernels a round fused into a few (benchmarks'
# switch: `bench.tuned` {"engine": {"SPEC_GLUE_COMPILED": true}})
SPEC_GLUE_COMPILED = False

# a round's record [B, RECORD + 2 (W - 1)]: path length, bonus, finite, drawable, tree size,
# then the path's tokens and nodes
RECORD = 5


class SpecSteps:
    """StaticEngine's DDTree rounds back to back (a mixin: it reads the engine's pool, target,
    DFlash drafter, sampler and timing)."""

    def _spec_rounds(self, seqs: list[Sequence], params: LiveParams, steps: int):
        """Up to `steps` rounds of every sequence, or None where fewer than two fit (the
        context's end) or the rounds cannot run on the device: the caller runs one."""
        depth = self.block_depth(params.budget)
        if not self.device_tree or depth <= 0:
            return None
        t0 = time.perf_counter()
        pool, sd, target = self.pool, self.sdraft, self.target
        ml = pool.max_len
        w, bound = self.tree_width(params.budget, params.topk, depth)
        adv = depth + 1  # the most entries a round commits
        starts = np.array([seq.cache.length for seq in seqs], dtype=np.int64)
        # every entry the rounds write lies within the slot (a finishing request's, the guard's)
        room = (ml - max(w, adv) - int(starts.max())) // adv + 1
        k = min(steps, room, max(rounds_left(seq) for seq in seqs))
        if k < 2:
            return None
        reach = (k - 1) * adv
        for seq in seqs:
            seq.cache.reserve(reach + w)
        trees = self._draft_trees(seqs, params, reach)
        t1 = time.perf_counter()
        b = trees.tokens.shape[0]
        slots = np.array([seq.cache.slot for seq in seqs], dtype=np.int64)
        state, tg, out = self._spec_stage(b, w, slots, starts)
        tkey = (True, b, w, target.ctx_bucket(int(starts.max()) + w + reach))
        biased = [
            (seq.cache.slot * w, bound, seq.bias)
            for seq in seqs
            if seq.bias is not None and seq.sampling.greedy
        ]
        sampled = [
            SampleGroup(seq.cache.slot * w, bound, seq.sampling, seq.bias, seq.generator)
            for seq in seqs
            if not seq.sampling.greedy
        ]
        inputs = self.sampler.staged(sampled, state.device) if sampled else None

        def choose(logits):  # the biased argmax and the samples (inputs staged once)
            for r0, n, bias in biased:
                tg[0, r0 : r0 + n] = (logits[r0 : r0 + n] + bias).argmax(-1)
            if sampled:
                rows, drawn, ok = sample_rows(logits, sampled, inputs)
                tg[0, rows] = drawn
                tg[2, rows] = ok.long()

        dkey = sd.last_key
        for r in range(k):
            if r:
                trees = DeviceTrees(*sd.again(), w, bound)
            out[r].copy_(self._spec_round(trees, tkey, dkey, params.window, choose))
        record = out[:k].cpu().numpy()  # the rounds' one sync
        t2 = time.perf_counter()
        result = [
            self._spec_commit(seq, record[:, s], int(n0), w)
            for seq, s, n0 in zip(seqs, slots.tolist(), starts.tolist(), strict=True)
        ]
        t3 = time.perf_counter()
        self.round_steps = k
        tm = self.timing
        tm["rounds"] += k
        tm["trips"] += 1
        tm["verify_s"] += t2 - t1
        tm["accept_s"] += t3 - t2
        for seq, new in zip(seqs, result, strict=True):
            if not isinstance(new, Exception):
                seq.stats.draft_s += (t1 - t0) / len(seqs)
                seq.stats.verify_s += t3 - t1
        return result

    def _spec_round(self, trees: DeviceTrees, tkey: tuple, dkey: tuple, window: int, choose):
        """One round on the device from `trees` (a draft of shape `dkey`): the verify's inputs,
        the verify of shape `tkey`, the target's choices (`choose(logits)` adds the biased and
        sampled ones), the glue, the KV moves. Returns the round's record (on the device)."""
        pool, target, sd = self.pool, self.target, self.sdraft
        b, w = trees.tokens.shape
        depth, ml = dkey[1], pool.max_len
        state, tg, _ = self._spec_buffers(b, w)
        inp, dinp = target.buffer(tkey), sd._inputs(dkey)
        fill_fn, glue_fn = self.spec_glue
        ptr = trees.tokens.data_ptr()
        self._spec_run(("fill", tkey, ptr), lambda: fill_fn(inp, trees, state, ml))
        logits, top, taps = target.replay(tkey)
        tg[:2].copy_(top)
        choose(logits)
        moves, nxt, record = self._spec_run(
            ("glue", tkey, dkey, window, ptr, taps.data_ptr()),
            lambda: glue_fn(
                trees,
                tg,
                taps,
                state,
                sd.feats,
                sd.new_rows,
                dinp,
                pool.kv_heads,
                ml,
                depth,
                window,
            ),
        )
        pool.move_entries(moves[0], moves[1])
        state.copy_(nxt)
        return record

    @torch.inference_mode()
    def spec_warm_up(self, drafted: tuple, dkey: tuple, contexts: list[int], window: int) -> None:
        """The glue graphs of the rounds after a draft of shape `dkey` (its outputs
        `drafted`), for verifies of every context class in `contexts` (the engine's
        warm_up): one round in which no row holds a request (guard entries only)."""
        b, w = dkey[0], dkey[-1]
        self._spec_stage(b, w, np.zeros(0, np.int64), np.zeros(0, np.int64))
        trees = DeviceTrees(*drafted, w, w)
        for ctx in contexts:
            if ctx >= w:
                self._spec_round(trees, (True, b, w, ctx), dkey, window, lambda _: None)

    def _spec_commit(self, seq: Sequence, rows: np.ndarray, n0: int, w: int) -> Outcome:
        """One sequence's tokens of the rounds' records `rows` [k, RECORD + 2 (W - 1)], up to
        its stop; its host state moved to where the device's is."""
        tokens, made, bad = [], [], None
        for r in range(rows.shape[0]):
            n, bonus, finite, drawable = rows[r, :4].tolist()
            if not finite or (not drawable and not seq.sampling.greedy):
                bad = NON_FINITE if not finite else NO_DISTRIBUTION
                break
            tokens += [*rows[r, RECORD : RECORD + n].tolist(), bonus]
            made.append(n + 1)
        new = truncate_at_stop(seq, tokens, self.eos_token_ids)
        failed = bad is not None and not seq.finished  # a round before its stop went wrong
        if failed and not made:
            seq.finish_reason = "error"
            return EngineError(bad)
        used = int(np.searchsorted(np.cumsum(made), len(new))) + 1  # rounds it keeps tokens of
        kept = made[:used]
        kept[-1] -= sum(made[:used]) - len(new)
        nodes = RECORD + w - 1  # where a record's path nodes start
        seq.last_paths = [row[nodes : nodes + int(row[0])].tolist() for row in rows[:used]]
        seq.cache.length = n0 + sum(made)
        seq.pending = made[-1]  # the last round's root + path: its feature rows, unwritten
        seq.draft_state = seq.cache.length - seq.pending
        seq.tokens.extend(new)
        seq.output.extend(new)
        st = seq.stats
        st.draft_tokens += int(rows[:used, 4].sum()) - used
        st.verify_rounds += used
        st.completion_tokens += len(new)
        st.accept_lengths.extend(kept)
        if failed:  # it ends after the rounds before that one: their tokens delivered first
            seq.finish_reason = "error"
            return ended_after(EngineError(bad), new)
        return new

    def _spec_stage(self, b: int, w: int, slots: np.ndarray, starts: np.ndarray):
        """The rows' state for a call's rounds, copied up without a sync: the requests' in
        `slots` at committed lengths `starts`; the other rows' entries the guard's, moved
        onto themselves. The target's choices reset to drawable. Returns `_spec_buffers`."""
        state, tg, out = self._spec_buffers(b, w)
        host = np.zeros((2, b), dtype=np.int64)
        host[0] = self.pool.max_len - w
        host[0, slots], host[1, slots] = starts, 1
        self.target.staging.copy(state, host.ravel())
        tg[2].fill_(1)
        return state, tg, out

    def _spec_buffers(self, b: int, w: int):
        """Per (B, W): the rows' state [2 B] (committed length, whether a request is in the
        round), the target's choices [3, B W] (token, finite, drawable) and the rounds'
        records [64, B, RECORD + 2 (W - 1)]."""
        key = (b, w)
        if key not in self._spec:
            dev = self.pool.kv.device
            self._spec[key] = (
                torch.zeros(2 * b, dtype=torch.long, device=dev),
                torch.ones(3, b * w, dtype=torch.long, device=dev),
                torch.zeros(64, b, RECORD + 2 * (w - 1), dtype=torch.long, device=dev),
            )
        return self._spec[key]

    def _spec_run(self, key, fn):
        """`fn` through a CUDA graph of `key` where the target's and the drafter's run in
        graphs (their outputs, which `fn` reads, then stay put), else eagerly."""
        if self.target.graphs.enabled and self.sdraft.graphs.enabled:
            return self.spec_graphs.run(key, fn)
        return fn()


def spec_glue(compiled: bool):
    """(fill_verify, round_glue), compiled where the engine compiles and SPEC_GLUE_COMPILED."""
    on = compiled and SPEC_GLUE_COMPILED
    return glue_compiled(fill_verify, on), glue_compiled(round_glue, on)


def rounds_left(seq: Sequence) -> int:
    """The rounds a sequence's answer needs at most by its token limit, at the accept length
    its recent rounds had (a guess that only sizes the rounds: too few costs one more host
    round trip, too many the rounds past its end)."""
    left = seq.sampling.max_tokens - len(seq.output)
    recent = seq.stats.accept_lengths[-16:]
    tau = sum(recent) / len(recent) if recent else 1.0
    return max(1, int(np.ceil(left / tau)))


def fill_verify(inp: torch.Tensor, trees: DeviceTrees, state: torch.Tensor, ml: int) -> None:
    """The verify's inputs (pack_target's layout) from the trees and the rows' state: write
    positions and lengths from each row's committed length; rows without a request write the
    guard's entries (as the host packs them)."""
    b, w = trees.tokens.shape
    start, active = state.view(2, b)
    act, j = active != 0, torch.arange(w, device=inp.device)
    wpos = torch.where(act[:, None], start[:, None] + j, ml - w + j)
    lens = torch.where(act, start, torch.zeros_like(start))
    rows = torch.arange(b, device=inp.device)
    parts = [trees.tokens, trees.positions, wpos, lens, rows, trees.mask]
    inp.copy_(torch.cat([t.reshape(-1) for t in parts]))


def round_glue(trees, tg, taps, state, feats, wn: int, dinp, kv_heads: int, ml: int, depth, window):
    """A round's accept on the device: each row's path and bonus (`accept_device` on the
    target's choices `tg` [3, B W]); the drafter's feature rows of its root + path copied
    from the verify's `taps` into `feats` [slots, rows, ...] (the next draft writes the first
    `wn` of a slot); the next draft's inputs written into `dinp`
    (static_dflash.pack_draft's layout). Returns the KV moves [2, B kvh W] (entries'
    indices as KVPool.move_entries takes them: to, from; identity past a path and in rows
    without a request), the rows' next state [2 B] and the round's record. Writes only what
    a second run writes alike (a graph capture's warm-up runs)."""
    b, w = trees.tokens.shape
    dev = trees.tokens.device
    start, active = state.view(2, b)
    act = active != 0
    t = tg.view(3, b, w)
    j, rows = torch.arange(w, device=dev), torch.arange(b, device=dev)
    keep, lengths, bonus = accept_device(trees.tokens, trees.parents, trees.mask, t[0])
    keep = torch.where(act[:, None], keep, j)
    lengths = torch.where(act, lengths, torch.zeros_like(lengths))
    nodes = trees.parents != -2
    finite = ((t[1] != 0) | ~nodes).all(1)
    drawable = ((t[2] != 0) | ~nodes).all(1)
    heads = (rows[:, None] * kv_heads + torch.arange(kv_heads, device=dev)) * ml  # [B, kvh]
    moves = torch.stack(
        [
            (heads[:, :, None] + (start[:, None] + j)[:, None, :]).reshape(-1),
            (heads[:, :, None] + (start[:, None] + keep)[:, None, :]).reshape(-1),
        ]
    )
    # feature rows 0.. of a slot (the draft just wrote the pending ones): its root + path;
    # rows without a request keep theirs (a request prefilling may hold that slot)
    stride = feats.shape[1]
    jj = min(w, wn)
    flat = feats.flatten(0, 1)
    to = (rows[:, None] * stride + j[:jj]).reshape(-1)
    new = taps.index_select(0, (rows[:, None] * w + keep[:, :jj]).reshape(-1))
    keeps = act[:, None].expand(b, jj).reshape(-1, 1)
    flat.index_copy_(0, to, torch.where(keeps, new, flat[to]))
    # the next draft's inputs (as Drafting._draft_trees packs them)
    n_new = lengths + 1
    nstart = torch.where(act, start + n_new, start)
    nroot = torch.where(act, bonus, torch.zeros_like(bonus))
    cj, qj = torch.arange(wn, device=dev), torch.arange(depth + 1, device=dev)
    cwpos = torch.where(act[:, None] & (cj < n_new[:, None]), start[:, None] + cj, ml - wn + cj)
    block = nstart[:, None] + qj
    parts = [
        cwpos,
        nroot,
        torch.where(act[:, None], block, ml - depth - 1 + qj),
        torch.where(act[:, None], block, torch.zeros_like(block)),
        torch.where(act, nstart, torch.zeros_like(nstart)),
        torch.where(act, torch.full_like(nstart, window), torch.full_like(nstart, ml)),
    ]
    dinp.copy_(torch.cat([p.reshape(-1) for p in parts]))
    ptok = trees.tokens.gather(1, keep)[:, 1:]
    head = torch.stack([lengths, bonus, finite.long(), drawable.long(), nodes.sum(1)], 1)
    record = torch.cat([head, ptok, keep[:, 1:]], 1)
    return moves, torch.cat([nstart, active]), record
