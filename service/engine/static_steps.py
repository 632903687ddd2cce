"""Several plain decoding steps in one round of the static engine (ddserve.engine.static_engine),
with no host round trip between them: vLLM's multi-step scheduling (`--num-scheduler-steps`).

An engine without a drafter decodes one token per request a step, and at one request a step
on the GPU (~0.65 ms for SmolLM2 on an H100) leaves the GPU idle while the host reads the
token back, accepts it, packs the next step's inputs and launches it (~0.12-0.19 ms a step,
bench/NOTES.md). Here a round of `steps` steps launches them back to back: each step's token
(argmax, or the request's sample: drawn on the device, with its own generator, bias and
filters) becomes the next step's input on the device, and positions, write positions and
lengths move one on there too; every step's tokens come back in one copy at the end. The
host's work of a step is then done once a round.

Exactly the tokens of as many one-step rounds (the same forward, the same argmax or draw per
step). What a round costs instead: a request's tokens arrive `steps` at a time, a request
whose answer ends inside a round pays the round's remaining steps (their tokens are
dropped: `truncate_at_stop`; their cache entries lie past its length and are never read),
and a request that arrives waits for the round in progress, so the runner runs one-step
rounds while prompts wait and for a request's first token (unless --first-token-share lets it
wait for the trip: ddserve.engine.rounds). Requests
that want log-probs take one-step rounds (their log-probs come from each step's logits). A
step with non-finite logits (or no drawable distribution) ends its request after the steps
before it: their tokens are committed and delivered before the error, as one-step rounds
would have streamed them.

An engine with a DFlash drafter takes these rounds at budget 0 too (adaptive speculation's
choice at a large batch, or `spec_max_batch`): each step's tapped target outputs go into
the drafter's buffered feature rows, as one-step budget-0 rounds put them, and the rows are
written as the drafter's context before a round they would not hold (at most a buffer's
rows a round) or by the next draft."""

from __future__ import annotations

import time

import numpy as np
import torch

from ddserve.engine.sampling import SampleGroup, sample_rows
from ddserve.engine.sequence import Outcome, Sequence, ended_after, truncate_at_stop
from ddserve.engine.static import next_bucket
from ddserve.engine.static_accept import NO_DISTRIBUTION, NON_FINITE
from ddserve.engine.static_models import pack_target
from ddserve.errors import EngineError


class Steps:
    """StaticEngine's multi-step rounds (a mixin: it reads the engine's pool, target and
    sampler)."""

    def _steps_round(self, seqs: list[Sequence], steps: int) -> list[Outcome]:
        """`steps` one-token steps of every sequence (no drafter, or a DFlash drafter at
        budget 0; none asks for log-probs); fewer where no request has that many tokens left
        to make (and, with a drafter, at most a feature buffer's rows)."""
        t0 = time.perf_counter()
        left = max(seq.sampling.max_tokens - len(seq.output) for seq in seqs)
        pool, target, sd = self.pool, self.target, self.sdraft
        if sd is not None:  # a DFlash drafter at budget 0: a feature row a step, buffered
            steps = min(steps, sd.rows)
            self._write_pending(seqs, min(steps, left))
        steps = self.round_steps = max(1, min(steps, left))
        b = next_bucket(pool.used_rows, 1, pool.slots)
        slots = np.array([seq.cache.slot for seq in seqs], dtype=np.int64)
        starts = np.array([seq.cache.length for seq in seqs], dtype=np.int64)
        for seq in seqs:  # the round's entries run past a finishing request's end: the guard's
            seq.cache.reserve(steps)
        tokens = np.zeros((b, 1), dtype=np.int64)
        pos = np.zeros((b, 1), dtype=np.int64)
        wpos = np.full((b, 1), pool.max_len - 1, dtype=np.int64)  # shape-only rows: the guard
        lens = np.zeros(b, dtype=np.int64)
        tokens[slots, 0] = [seq.tokens[-1] for seq in seqs]
        pos[slots, 0] = wpos[slots, 0] = lens[slots] = starts
        ctx = target.ctx_bucket(int(starts.max()) + steps)
        tree = np.ones((b, 1, 1), dtype=bool)
        packed = pack_target(tokens, pos, wpos, lens, np.arange(b), tree)
        biased_greedy = [
            (int(s), seq.bias)
            for s, seq in zip(slots, seqs, strict=True)
            if seq.bias is not None and seq.sampling.greedy
        ]
        sampled = [
            SampleGroup(int(s), 1, seq.sampling, seq.bias, seq.generator)
            for s, seq in zip(slots, seqs, strict=True)
            if not seq.sampling.greedy
        ]
        dev = pool.kv.device
        out = torch.ones((steps, 3, b), dtype=torch.long, device=dev)
        key, inputs = (True, b, 1, ctx), None
        if sd is not None:  # each step's input's tapped row into its slot's next feature row
            at = slots * sd.rows + np.array([seq.pending for seq in seqs], dtype=np.int64)
            if self._feed is None:  # the feature rows' destinations, then the taps' rows
                self._feed = torch.zeros(2 * pool.slots, dtype=torch.long, device=dev)
            target.staging.copy(self._feed, np.concatenate([at, slots]))  # no host wait
            feed = self._feed
            feats = sd.feats.flatten(0, 1)
        t1 = time.perf_counter()
        for i in range(steps):
            if i == 0:
                logits, top, taps = target.forward(packed, b, 1, ctx, True)
            else:
                logits, top, taps = target.forward_next(key, out[i - 1, 0])
            if sd is not None:  # copied now: the next step's replay overwrites `taps`
                n = len(seqs)
                feats.index_copy_(0, feed[:n] + i, taps.index_select(0, feed[n : 2 * n]))
            out[i, :2].copy_(top)
            for s, bias in biased_greedy:  # its argmax under the bias
                out[i, 0, s] = (logits[s] + bias).argmax(-1)
            if sampled:  # their samples (inputs staged once a round: no host wait per step)
                if inputs is None:
                    inputs = self.sampler.staged(sampled, pool.kv.device)
                rows, drawn, ok = sample_rows(logits, sampled, inputs)
                out[i, 0, rows] = drawn
                out[i, 2, rows] = ok.long()
        host = out.cpu().numpy()  # the round's one sync
        t2 = time.perf_counter()
        result: list[Outcome] = []
        for s, seq in zip(slots.tolist(), seqs, strict=True):
            new = truncate_at_stop(seq, host[:, 0, s].tolist(), self.eos_token_ids)
            bad = np.flatnonzero(host[: len(new), 1, s] == 0)
            if not seq.sampling.greedy:
                bad = np.union1d(bad, np.flatnonzero(host[: len(new), 2, s] == 0))
            err = None
            if bad.size:  # a step that went wrong: the request ends after the steps before it
                err = EngineError(NON_FINITE if host[bad[0], 1, s] == 0 else NO_DISTRIBUTION)
                new = new[: int(bad[0])]
            seq.last_paths = []
            seq.cache.length += len(new)  # the inputs of its kept steps
            if sd is not None:
                seq.pending += len(new)  # their feature rows, for the drafter's context
            seq.tokens.extend(new)
            seq.output.extend(new)
            st = seq.stats
            st.verify_s += t2 - t0
            st.verify_rounds += len(new)
            st.completion_tokens += len(new)
            st.accept_lengths.extend([1] * len(new))
            if err is not None:
                seq.finish_reason = "error"
                result.append(ended_after(err, new))
                continue
            result.append(new)
        tm = self.timing
        tm["rounds"] += steps  # forward rounds (a call of several: as many)
        tm["trips"] += 1
        tm["verify_s"] += t2 - t1
        tm["accept_s"] += time.perf_counter() - t2 + t1 - t0
        return result
