"""Prompts into the static engine's KV slots (ddserve.engine.static_engine); the graphs
captured at start-up and the round times measured then: ddserve.engine.static_startup.

  * prefill in chunks through the verify's forward (up to PREFILL_ROWS prompts per forward,
    causal, no logits), at most `max_tokens` prompt tokens per call when the caller asks
    (chunked prefill: the runner interleaves a long prompt's chunks with the running requests'
    rounds); a capturing drafter keeps the prompt's tapped outputs. A chunk whose shape has a
    CUDA graph is padded to that shape (fixed widths, power-of-two rows); any other runs
    without a graph, exactly as wide as its tokens (StaticTarget.prefill_eager)
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ddserve.engine.sequence import Sequence
from ddserve.engine.static import next_bucket
from ddserve.engine.static_models import FRESH_CTX, pack_target

log = logging.getLogger(__name__)

PREFILL_CHUNKS = (16, 64, 256)  # prompt chunk widths, sdpa (it reads a padded key range)
# with the triton kernel; 512: a paced budget between 512 and 1,023 tokens fills half of it
# or more in one forward (the pacer measures such rounds)
PREFILL_CHUNKS_LONG = (16, 64, 256, 512, 1024, 2048)
PREFILL_ROWS = 8  # prompts prefilled together in one forward
# a prompt this short (a chat turn) may go in ahead of an older long one being chunked (allot)
SHORT_TOKENS = 256
# a prompt's first chunk under CUDA graphs (its rows all start at an empty context: attention
# over the chunk's own keys by torch's fused kernels, attention.FRESH): widths up to the
# pool's, so a prompt of up to 8,192 tokens to an idle engine is one forward (on the H200 a
# 7,200-token prompt took 35.5 ms in 2,048-token chunks, 26 of them in the triton kernel's
# attention, where cuDNN's causal attention over all 7,200 took 5.2); at most FRESH_TOKENS
# tokens (rows x width) a forward, as the widest chunks of the other classes. A prompt pads
# to the next width, and its padded rows pay the causal attention too (its cost grows with
# the width squared): every 512 tokens above 4,096 (a 7,200-token prompt in 7,680 rows took
# 12.2 ms against 12.8 in 8,192 on the H200; a width costs two graphs at warm-up)
FRESH_CHUNKS = (1024, 2048, 3072, 4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192)
FRESH_TOKENS = 16384
# prompt tokens of one forward without a graph while nothing decodes: a long prompt in one
# (fused attention's memory is linear; on the H200 one 7,200-token causal attention took 0.18
# ms a layer against ~0.5 in 2,048-token chunks, on this CPU a whole 2,000-token prefill 17%
# less time than 256-token chunks: bench/NOTES.md)
PREFILL_WHOLE = 8192


def fresh_chunks(max_len: int, usable: int | None = None) -> tuple[int, ...]:
    """The fresh-prompt chunk widths a pool of `max_len` entries a slot takes, up to the first
    that holds `usable` entries (a request's most: no prompt is longer)."""
    out: list[int] = []
    for w in FRESH_CHUNKS:
        if w > max_len:
            break
        out.append(w)
        if usable is not None and w >= usable:
            break
    return tuple(out)


def fresh_rows(w: int) -> int:
    """Rows of a fresh chunk of width w in one forward: a power of two, FRESH_TOKENS at most."""
    return 1 << max(0, min(PREFILL_ROWS, FRESH_TOKENS // w).bit_length() - 1)


def bucket_sizes(hi: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two below `hi`, and `hi`."""
    out, b = [], 1
    while b < hi:
        out.append(b)
        b *= 2
    return [*out, hi]


class Prefill:
    """StaticEngine's prefill and warm-up (a mixin: it reads the engine's pool, target,
    drafter and chunk widths)."""

    def prefill(self, seq: Sequence) -> None:
        self.prefill_batch([seq])

    @staticmethod
    def prompt_left(seq: Sequence) -> int:
        """Prompt tokens (all but its last) not yet in the sequence's KV slot."""
        return len(seq.tokens) - 1 - seq.cache.length

    @classmethod
    def prefilled(cls, seq: Sequence) -> bool:
        """Whether a sequence's prompt (all but its last token) is in its KV slot."""
        return cls.prompt_left(seq) <= 0

    @torch.inference_mode()
    def prefill_batch(
        self, seqs: list[Sequence], max_tokens: int | None = None, overlap: bool = False
    ) -> int:
        """Prefill the prompts (all but their last token) of up to PREFILL_ROWS requests per
        forward; each row reads and writes its own slot. With `max_tokens` (chunked prefill:
        the runner interleaves prompts with the running requests' rounds), at most about that
        many prompt tokens go in (`allot`); a later call goes on where this one stopped
        (`prefilled` says when a prompt is in). Returns the prompt tokens that went in.

        `overlap` (on CUDA): the forwards go to a stream of their own and this returns once
        they are launched, so the caller's next forward (the running requests' decode step,
        on its own stream) runs beside them on the GPU; `join_prefill` waits for them and must
        come before any of these sequences is stepped, or prefilled again. The two touch
        different slots (a slot that only pads the decode forward's shape takes writes in its
        guard entries alone, which no real row reads). Elsewhere it runs as without."""
        quotas = self.allot(seqs, max_tokens)
        taking = [seq for seq in seqs if quotas.get(id(seq), 0) > 0]
        side = self._side_stream() if overlap and taking else None
        if side is None:
            return sum(
                self._prefill_rows(taking[at : at + PREFILL_ROWS], quotas)
                for at in range(0, len(taking), PREFILL_ROWS)
            )
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # what the slots' last rounds wrote
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            with torch.cuda.stream(side):
                start.record()
                spent = sum(
                    self._prefill_rows(taking[at : at + PREFILL_ROWS], quotas, main)
                    for at in range(0, len(taking), PREFILL_ROWS)
                )
                end.record()
        except BaseException:
            side.synchronize()  # what was launched has run before anyone retries these slots
            raise
        self._launched = (start, end, taking)
        return spent

    def join_prefill(self) -> float | None:
        """Wait for the prefill `prefill_batch(overlap=True)` launched; its GPU time in
        seconds (beside whatever ran with it), or None when none is under way."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        start, end, seqs = launched
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        for seq in seqs:
            seq.stats.prefill_s += seconds
        return seconds

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The overlapped prefill's stream (CUDA only): the prompt chunks' graph lane's
        capture stream, so that chunks without a graph share the cuBLAS workspace of those
        graphs only, on the one stream that runs them all (a stream drawn anew could be any
        of the pool's, another lane's capture stream among them)."""
        if self.model.device.type != "cuda":
            return None
        if self._side is None:
            lanes = self.target.graphs.lanes
            self._side = lanes[1].capture if lanes else torch.cuda.Stream(self.model.device)
        return self._side

    def allot(self, seqs: list[Sequence], max_tokens: int | None) -> dict[int, float]:
        """Prompt tokens each sequence (by id, `seqs` oldest first) may take in one call.
        Without a budget, all; with one of 0 or less, none. Otherwise first come first, as
        vLLM's and SGLang's chunked prefill: in order, a prompt whose rest fits what is left
        goes in whole (a burst of short prompts is admitted whole, never cut into narrow
        chunks), one that does not waits; the oldest prompt longer than the whole budget
        takes what is left (at least the narrowest chunk when nothing older took any) and
        younger ones wait for it. Sharing the budget among long prompts made every one of
        them finish last: 16 prompts of 2,900 tokens joining a running batch on the H200 got
        their first tokens after 8.8 s at the median. But younger short prompts (at most
        SHORT_TOKENS: a chat turn) go ahead of it within half the budget, as vLLM's
        `long_prefill_token_threshold` lets them: a chat turn arriving behind an 8,000-token
        document waited for all of it (20 s on a 2-core CPU), and the long prompt still
        moves by half the budget at least. At most the budget goes in, or the narrowest chunk
        where the budget is smaller."""
        rests = [(seq, self.prompt_left(seq)) for seq in seqs]
        if max_tokens is None:
            return {id(seq): float("inf") for seq, rest in rests if rest > 0}
        if max_tokens <= 0:
            return {}
        narrow = self.chunks[0]
        quotas, left, long, ahead = {}, max_tokens, None, max_tokens // 2
        for seq, rest in rests:
            if rest <= 0:
                continue
            if long is None and rest <= left:
                quotas[id(seq)] = rest
                left -= rest
            elif long is None and rest > max_tokens:  # the oldest long prompt
                long = seq
            elif long is not None and rest <= min(SHORT_TOKENS, ahead, left - narrow):
                quotas[id(seq)] = rest  # a younger chat turn, ahead of it
                left, ahead = left - rest, ahead - rest
        if long is not None and (left >= narrow or not quotas):
            quotas[id(long)] = max(left, narrow)
        return quotas

    def _prefill_rows(self, seqs: list[Sequence], quotas: dict[int, float], main=None) -> int:
        """One or more forwards of up to PREFILL_ROWS prompts; `main`: launched on a side
        stream beside that one (overlapped: nothing waits for them here)."""
        t0 = time.perf_counter()
        heads = [seq.tokens[:-1] for seq in seqs]
        left_q = [quotas[id(seq)] for seq in seqs]  # tokens each row may still take
        ml = self.pool.max_len
        spent = 0
        while True:
            rest = {i: len(h) - seqs[i].cache.length for i, h in enumerate(heads)}
            # a row cut short by its quota stops once that is below the narrowest chunk
            todo = [
                i
                for i in rest
                if rest[i] > 0
                and left_q[i] > 0
                and (left_q[i] >= rest[i] or left_q[i] >= self.chunks[0])
            ]
            if not todo:
                break
            need = {i: min(rest[i], left_q[i]) for i in todo}
            # the chunk widths with graphs: a row that ends its prompt pads up to one; a row
            # cut short takes whole chunks (the widest within its quota: no padded waste)
            fresh = {i: seqs[i].cache.length == 0 for i in todo}  # a first chunk
            fit = {
                i: need[i] if need[i] == rest[i] else self._floor_chunk(need[i], fresh[i])
                for i in todo
            }
            width = {i: self._chunk(fit[i], fresh[i]) for i in todo}
            w = max(width.values())
            # rows whose own width is under half of it wait for a forward of their own (a
            # short prompt would otherwise pay the long one's width in every matmul)
            rows_in = [i for i in todo if 2 * width[i] >= w]
            ctx = None
            if w in self.fresh_chunks and (w > self.chunks[-1] or all(fresh[i] for i in rows_in)):
                # first chunks alone, under the fresh class (wider than the other classes'
                # chunks: fresh rows only; at most FRESH_TOKENS tokens)
                rows_in = [i for i in rows_in if fresh[i]][: fresh_rows(w)]
                w, ctx = max(width[i] for i in rows_in), FRESH_CTX
            b = next_bucket(len(rows_in), 1, PREFILL_ROWS)
            longest = max(seqs[i].cache.length for i in rows_in) + w
            take = {i: min(need[i], w) for i in rows_in}
            if ctx is None:
                ctx = self.target.ctx_bucket(longest)
            if self.target.prefill_eager((False, b, w, ctx)):
                # no graph: the rows there are and what they take exactly, nothing padded;
                # up to PREFILL_WHOLE tokens in one forward (a long prompt to an idle engine)
                cap = max(self.chunks[-1], PREFILL_WHOLE // len(todo))
                take = {i: min(need[i], cap) for i in todo}
                w = max(take.values())
                rows_in = [i for i in todo if 2 * take[i] >= w]
                w, b = max(w, 2), len(rows_in)  # (a width of 1 would be a shape of its own)
                # the class of the rows there are (the ragged path reads none: a key that
                # names a class its rows do not fit must never reach a graph)
                ctx = self.target.ctx_bucket(max(seqs[i].cache.length for i in rows_in) + w)
            todo = rows_in
            toks = np.zeros((b, w), dtype=np.int64)
            # rows that only fill the shape write into the guard entries only (a chunk wider
            # than the guard would reach real ones: entries clamped to the guard's first take
            # several writes of garbage; nothing reads them) of the chunk's first prompt's
            # slot: never a slot being stepped, whose tree may reach its guard near the end of
            # its context, while this chunk runs beside that step (overlapped prefill)
            pos = np.tile(np.maximum(np.arange(ml - w, ml), ml - self.pool.guard), (b, 1))
            lens = np.zeros(b, dtype=np.int64)
            rows = np.full(b, seqs[todo[0]].cache.slot, dtype=np.int64)
            takes, longest = [], 0
            for r, i in enumerate(todo):
                at = seqs[i].cache.length
                n = take[i]
                toks[r, :n] = heads[i][at : at + n]
                # the chunk's padding past the prompt may run beyond the pool: clamp it to the
                # last (guard) entry; no real token sees it (causal), and it is never kept
                pos[r] = np.minimum(at + np.arange(w), ml - 1)
                lens[r], rows[r] = at, seqs[i].cache.slot
                takes.append((r, i, n))
                longest = max(longest, at + w)
            packed = pack_target(toks, pos, pos, lens, rows)  # causal: no tree
            _, _, taps = self.target.forward(packed, b, w, ctx, False)
            for r, i, n in takes:
                if taps is not None:
                    kept = taps[r * w : r * w + n].clone()
                    if main is not None:  # read on the main stream, made on this one
                        kept.record_stream(main)
                    seqs[i].hidden_new.append(kept)
                seqs[i].cache.length += n
                left_q[i] -= n
                spent += n
                # a row cut short by its quota takes one forward of the widest chunk within
                # it, then stops, unless the rest still holds a widest chunk: a forward under
                # a graph costs about a decode step whatever its width (~1.1 ms on the H200),
                # so 64 + 16 + 16 cost three where 64 cost one
                if need[i] < rest[i] and left_q[i] < self.chunks[-1]:
                    left_q[i] = 0
        if main is not None:  # launched only: join_prefill counts its time
            return spent
        if self.model.device.type == "cuda":  # the work done, not its launch (stats, pacing)
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        for seq in seqs:
            seq.stats.prefill_s += elapsed
        return spent

    def _guard_chunk(self, b: int, w: int, ctx: int) -> None:
        """A prompt-chunk forward of shape (b, w, ctx) that writes only guard entries (the
        warm-up's capture of that shape, or its run without a graph)."""
        ml = self.pool.max_len
        guard = np.tile(np.arange(ml - w, ml), (b, 1))
        zeros = np.zeros(b, np.int64)
        packed = pack_target(np.zeros((b, w), np.int64), guard, guard, zeros, zeros)
        self.target.forward(packed, b, w, ctx, False)

    def _widths(self, fresh: bool) -> list[int]:
        """The chunk widths a row may take (a first chunk: the fresh class's too)."""
        return sorted({*self.chunks, *self.fresh_chunks}) if fresh else list(self.chunks)

    def _chunk(self, n: int, fresh: bool = False) -> int:
        """The narrowest chunk of at least n tokens (the widest if none)."""
        widths = self._widths(fresh)
        return next((c for c in widths if c >= n), widths[-1])

    def _floor_chunk(self, n: int, fresh: bool = False) -> int:
        """The widest chunk of at most n tokens (the narrowest if none)."""
        return max([c for c in self._widths(fresh) if c <= n] or [self.chunks[0]])
