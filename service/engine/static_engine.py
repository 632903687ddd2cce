"""The DDTree engine, on CPU and GPU alike: prefill, then per round draft -> build_tree ->
verify -> accept -> commit (the algorithm: DESIGN.md; the simpler reference it must match
token for token is tests/engine/reference.py), over static state:

  * one preallocated KV pool; a request holds a slot from `new_sequence` to `release`
  * the verify of every active request in one fixed-shape forward (rows = slots 0..B-1,
    W = tree width bucket, ctx = key-length bucket), captured as a CUDA graph per shape
  * prefill in chunks of fixed widths through the same forward (up to 8 prompts, causal, no
    logits), at most `max_tokens` prompt tokens per call when the caller asks (chunked
    prefill: the runner interleaves a long prompt's chunks with the running requests' rounds)
  * attention by ddserve.engine.attention: the triton kernel on CUDA (each row's own keys;
    a graph per shape and context class, which only bounds the key splits), the sdpa
    reference elsewhere
  * the DFlash drafter batched the same way over its own pool (context keys/values written
    in place, no per-round allocation), also graph-captured; rounds without a draft (budget
    0) buffer their feature rows and write the context only when a slot's rows are full
  * argmax and the finiteness check inside the graph: one device->host copy per verify;
    accepted paths move in the pool with one gather/scatter for the whole batch
  * logit_bias: added to the target's logits at every node of a biased request's tree
    (outside the graph, only when a request of the round has one), before its tokens are
    chosen, so speculation stays lossless under the bias
  * raw log-probs of the emitted tokens from the verify's own logits at the accepted
    path's rows (root + accepted nodes: the rows the emitted tokens were chosen at), only
    for requests that ask, one device->host copy per round for all of them

CUDA graphs only where CUDA is (`torch.compile` of the decoder layer when asked); on CPU the
same code runs eagerly. Host work per round (tree build, accept walk, packing inputs) is
timed in `self.timing`. Drafters other than DFlash (n-gram lookup, a draft model, the
target's first layers) draft through their own `draft` over their own caches.
`budget=0` (or no draft) verifies the root alone: plain autoregressive decoding through the
same code. Parameters are read once per round, so a live change is atomic per round.
"""

from __future__ import annotations

import logging
import secrets
import time

import numpy as np
import torch

from ddserve.config.engine import MAX_TOPK, LiveParams
from ddserve.engine.attention import backend as attention_backend
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import DraftContext, Drafter
from ddserve.engine.llama import Llama
from ddserve.engine.sampling import (
    Logprobs,
    SamplingParams,
    bias_vector,
    gather_logprobs,
    target_tokens,
)
from ddserve.engine.sequence import Outcome, Sequence, truncate_at_stop
from ddserve.engine.static import (
    KVPool,
    SlotCache,
    compile_layer_step,
    fit_slots,
    layer_step,
    next_bucket,
)
from ddserve.engine.static_models import (
    StaticDFlash,
    StaticTarget,
    pack_draft,
    pack_target,
    pool_length,
)
from ddserve.engine.tree import (
    DeviceTrees,
    Tree,
    accept,
    ancestor_mask,
    build_tree,
    build_tree_top,
    size_bound,
)
from ddserve.errors import EngineError

log = logging.getLogger(__name__)

PREFILL_CHUNKS = (16, 64, 256)  # prompt chunk widths, sdpa (it reads a padded key range)
PREFILL_CHUNKS_LONG = (16, 64, 256, 1024, 2048)  # with the triton kernel
PREFILL_ROWS = 8  # prompts prefilled together in one forward


def bucket_sizes(hi: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two below `hi`, and `hi`."""
    out, b = [], 1
    while b < hi:
        out.append(b)
        b *= 2
    return [*out, hi]


class StaticEngine:
    """The algorithm over one target model and one drafter; no threads, no I/O. `slots`
    requests at a time, each up to `max_context` tokens; `graphs` applies only on CUDA,
    `compile` wherever asked (the runner asks on CUDA)."""

    accept = staticmethod(accept)  # the accept rule (ddserve.engine.tree); a test seam

    def __init__(
        self,
        model: Llama,
        drafter: Drafter,
        depth: int,
        eos_token_ids: tuple[int, ...],
        *,
        slots: int,
        max_context: int,
        graphs: bool = True,
        compile: bool = False,
        attention: str = "auto",
        memory_fraction: float | None = None,
        device_tree: bool | None = None,
    ):
        self.model = model
        self.drafter = drafter
        self.depth = depth
        self.eos_token_ids = frozenset(eos_token_ids)
        # target layers whose outputs the drafter is conditioned on (kept from verify)
        self.capture: tuple[int, ...] = tuple(getattr(drafter, "capture", ()))
        graphs = graphs and model.device.type == "cuda"
        if memory_fraction is not None and model.device.type == "cuda":
            slots = self._slots_that_fit(model, drafter, slots, max_context, memory_fraction)
        layer_fn = compile_layer_step() if compile else layer_step  # the hot step, compiled once
        self.attention = attention_backend(attention, model.device)
        self.chunks = PREFILL_CHUNKS_LONG if self.attention == "triton" else PREFILL_CHUNKS
        self.target = StaticTarget(
            model,
            slots,
            max_context,
            self.capture,
            graphs,
            layer_fn=layer_fn,
            attention=self.attention,
        )
        self.pool = self.target.pool
        self.sdraft = None
        if isinstance(drafter, DFlashDrafter):
            self.sdraft = StaticDFlash(
                drafter,
                self.pool.slots,
                self.pool.max_len,
                self.pool.guard,
                graphs,
                layer_fn=layer_fn,
                attention=self.attention,
            )
        # DFlash trees built on the GPU (ddserve.engine.tree_triton) where triton kernels run:
        # auto = with CUDA and triton; True off CUDA only under TRITON_INTERPRET (the tests)
        if device_tree is None:
            device_tree = (
                model.device.type == "cuda" and attention_backend("auto", model.device) == "triton"
            )
        self.device_tree = bool(device_tree) and self.sdraft is not None
        self.timing = {"rounds": 0, "draft_s": 0.0, "tree_s": 0.0, "verify_s": 0.0, "accept_s": 0.0}

    @staticmethod
    def _slots_that_fit(model, drafter, slots: int, max_context: int, fraction: float) -> int:
        """The KV slots (target's pool + the DFlash drafter's) that fit in the GPU's memory;
        fewer than asked is logged."""
        max_len = pool_length(max_context)
        per_slot = KVPool.slot_bytes(model.cfg, model.cfg.num_layers, max_len, model.dtype)
        if isinstance(drafter, DFlashDrafter):  # its pool has the target's slots and length
            c = drafter.net.c
            per_slot += KVPool.slot_bytes(c, c.num_layers, max_len, model.dtype)
        free, total = torch.cuda.mem_get_info(model.device)
        n = fit_slots(slots, per_slot, free, total, fraction)
        if n < slots:
            log.warning(
                "KV pool: %d of %d slots fit (%.2f GiB each at max_context=%d, "
                "gpu_memory_utilization=%g); more requests wait for a free slot",
                n, slots, per_slot / (1 << 30), max_context, fraction,
            )  # fmt: skip
        return n

    @torch.inference_mode()
    def warm_up(self, params: LiveParams, contexts=(128, 256, 512), budgets=None) -> float:
        """Capture the graphs the current parameters use (every batch bucket, AR and tree
        widths, short contexts, the prefill chunks) with inputs that touch only guard
        entries; `budgets`: every budget rounds may use (adaptive speculation), by default
        the live one. Longer contexts and other widths are captured on first use."""
        if not self.target.graphs.enabled:
            return 0.0
        t0 = time.perf_counter()
        ml = self.pool.max_len
        budgets = sorted(set(budgets or [params.budget]))
        ctxs = sorted({self.target.ctx_bucket(c) for c in contexts})
        widths = sorted({2} | {self.tree_width(b, params.topk)[0] for b in budgets})
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
        for b in bucket_sizes(PREFILL_ROWS):
            for w in self.chunks:
                for ctx in ctxs:
                    if ctx >= w:
                        guard = np.tile(np.arange(ml - w, ml), (b, 1))
                        zeros = np.zeros(b, np.int64)
                        toks = np.zeros((b, w), np.int64)
                        packed = pack_target(toks, guard, guard, zeros, zeros)
                        self.target.forward(packed, b, w, ctx, False)
        if self.sdraft is not None:  # context-only rounds (budget 0)
            wn = self.sdraft.new_rows
            for b in bucket_sizes(self.pool.slots):
                self.sdraft.write_only(np.tile(np.arange(ml - wn, ml), (b, 1)))
        keys = set()  # the draft graphs' keys but batch size and context
        for budget in budgets if self.sdraft is not None else ():
            depth = min(self.depth, self.sdraft.block, budget)
            if depth > 0 and self.device_tree:
                keys.add((depth, params.topk, budget, self.tree_width(budget, params.topk)[0]))
            elif depth > 0:
                keys.add((depth, next_bucket(params.topk, 1, MAX_TOPK)))
        for depth, *rest in sorted(keys):
            q, wn = depth + 1, self.sdraft.new_rows
            for b in bucket_sizes(self.pool.slots):
                for ctx in ctxs:
                    packed = pack_draft(
                        np.tile(np.arange(ml - wn, ml), (b, 1)),
                        np.zeros(b, np.int64),
                        np.tile(np.arange(ml - q, ml), (b, 1)),
                        np.zeros((b, q), np.int64),
                        np.zeros(b, np.int64),
                        np.full(b, ml, np.int64),
                    )
                    self.sdraft.forward(packed, (b, depth, ctx, *rest))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    @property
    def graph_count(self) -> int:
        n = len(self.target.graphs.graphs)
        return n + (len(self.sdraft.graphs.graphs) if self.sdraft is not None else 0)

    # -- request lifecycle ----------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.pool.free

    def new_sequence(self, prompt: list[int], sampling: SamplingParams) -> Sequence:
        if len(prompt) > self.pool.usable:
            raise EngineError(
                f"prompt of {len(prompt)} tokens exceeds the KV slot's {self.pool.usable}"
            )
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))
        cache = SlotCache(self.pool, self.pool.acquire())
        seq = Sequence(
            list(prompt), sampling, cache, self.drafter.new_state(), gen, tokens=list(prompt)
        )
        seq.stats.prompt_tokens = len(prompt)
        seq.bias = bias_vector(sampling.logit_bias, self.model.cfg.vocab_size, self.model.device)
        if sampling.logprobs is not None:
            seq.logprobs = Logprobs()
        if self.sdraft is not None:
            seq.draft_state = 0  # context entries written to the drafter's slot
            seq.pending = 0  # rows of sdraft.feats[slot] not yet written as context
        return seq

    def release(self, seq: Sequence) -> None:
        if isinstance(seq.cache, SlotCache):
            self.pool.release(seq.cache.slot)
            seq.cache = None

    def prefill(self, seq: Sequence) -> None:
        self.prefill_batch([seq])

    @staticmethod
    def prefilled(seq: Sequence) -> bool:
        """Whether a sequence's prompt (all but its last token) is in its KV slot."""
        return seq.cache.length >= len(seq.tokens) - 1

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[Sequence], max_tokens: int | None = None) -> None:
        """Prefill the prompts (all but their last token) of up to PREFILL_ROWS requests per
        forward, in chunks of fixed widths; each row reads and writes its own slot. With
        `max_tokens`, chunks are at most that wide and the call stops once that many prompt
        tokens went in (the last forward may pass it by a chunk per row); a later call goes on
        where this one stopped (`prefilled` says when a prompt is in)."""
        spent = 0
        for at in range(0, len(seqs), PREFILL_ROWS):
            left = None if max_tokens is None else max_tokens - spent
            if left is not None and left <= 0:
                break
            spent += self._prefill_rows(seqs[at : at + PREFILL_ROWS], left)

    def _prefill_rows(self, seqs: list[Sequence], max_tokens: int | None) -> int:
        t0 = time.perf_counter()
        heads = [seq.tokens[:-1] for seq in seqs]
        ml = self.pool.max_len
        spent = 0
        while max_tokens is None or spent < max_tokens:
            todo = [i for i, h in enumerate(heads) if seqs[i].cache.length < len(h)]
            if not todo:
                break
            cap = self.chunks[-1]
            if max_tokens is not None:  # the widest chunk within what is left of the budget
                cap = max([c for c in self.chunks if c <= max_tokens - spent] or [self.chunks[0]])
            n_max = max(min(len(heads[i]) - seqs[i].cache.length, cap) for i in todo)
            w = next(c for c in self.chunks if c >= n_max)
            b = next_bucket(len(todo), 1, PREFILL_ROWS)
            toks = np.zeros((b, w), dtype=np.int64)
            pos = np.tile(np.arange(ml - w, ml), (b, 1))  # rows that only fill the shape
            lens, rows = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
            takes, longest = [], 0
            for r, i in enumerate(todo):
                at = seqs[i].cache.length
                n = min(len(heads[i]) - at, w)
                toks[r, :n] = heads[i][at : at + n]
                # the chunk's padding past the prompt may run beyond the pool: clamp it to the
                # last (guard) entry; no real token sees it (causal), and it is never kept
                pos[r] = np.minimum(at + np.arange(w), ml - 1)
                lens[r], rows[r] = at, seqs[i].cache.slot
                takes.append((r, i, n))
                longest = max(longest, at + w)
            packed = pack_target(toks, pos, pos, lens, rows)  # causal: no tree
            _, _, taps = self.target.forward(packed, b, w, self.target.ctx_bucket(longest), False)
            for r, i, n in takes:
                if taps is not None:
                    seqs[i].hidden_new.append(taps[r * w : r * w + n].clone())
                seqs[i].cache.length += n
                spent += n
        elapsed = time.perf_counter() - t0
        for seq in seqs:
            seq.stats.prefill_s += elapsed
        return spent

    def generate(self, prompt: list[int], sampling: SamplingParams, params: LiveParams) -> Sequence:
        """Run one request to completion (tests, benchmarks; the server uses `step_batch`)."""
        seq = self.new_sequence(prompt, sampling)
        try:
            self.prefill(seq)
            while not seq.finished:
                self.step(seq, params)
        finally:
            self.release(seq)
        return seq

    # -- one round of a batch -----------------------------------------------------------
    @torch.inference_mode()
    def step(self, seq: Sequence, params: LiveParams) -> list[int]:
        """One round of one sequence (see `step_batch`). Returns its new tokens."""
        out = self.step_batch([seq], params)[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def step_batch(self, seqs: list[Sequence], params: LiveParams) -> list[Outcome]:
        """One round of every sequence: draft and build each tree, verify all trees in one
        target forward, then accept and commit per sequence.

        Atomic per round: if the shared part (drafts, verify) raises, nothing was committed
        and the caller may retry. After it, each sequence's outcome is its own: its new
        tokens, or the exception that ended it (its commit did not happen; the others' did).
        Per-request stats: its share of the draft time, and the verify's wall time."""
        t0 = time.perf_counter()
        drafted = self._draft_trees(seqs, params)
        t1 = time.perf_counter()
        on_device = isinstance(drafted, DeviceTrees)
        b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
        if on_device:  # built on the GPU: only their sizes' bound is known here
            w, sizes = drafted.width, [drafted.bound] * len(seqs)
        else:
            sizes = [t.size for t in drafted]
            w = next_bucket(max(sizes), 2, 1 << 30)
        tokens = np.zeros((b, w), dtype=np.int64)
        pos = np.zeros((b, w), dtype=np.int64)
        wpos = np.tile(np.arange(self.pool.max_len - w, self.pool.max_len), (b, 1))
        lens = np.zeros(b, dtype=np.int64)
        tree_m = np.tile(np.eye(w, dtype=bool), (b, 1, 1))
        longest = 0
        for i, seq in enumerate(seqs):
            slot, n0 = seq.cache.slot, seq.cache.length
            if not on_device:
                tree = drafted[i]
                tokens[slot, : tree.size] = tree.tokens
                pos[slot, : tree.size] = n0 + np.asarray(tree.depths)
                tree_m[slot] = ancestor_mask(tree, w)
            wpos[slot] = n0 + np.arange(w)
            lens[slot] = n0
            longest = max(longest, n0 + w)
            seq.cache.reserve(sizes[i])
        ctx = self.target.ctx_bucket(longest)
        packed = pack_target(tokens, pos, wpos, lens, np.arange(b), tree_m)
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
        if on_device:  # the trees come back with the verify's argmax: still one sync
            both = torch.cat([top, *drafted.for_host(b * w)]).cpu().numpy()
            top = both[:2]
            trees = [drafted.tree(both[2:], seq.cache.slot * w, w) for seq in seqs]
        else:
            top, trees = top.cpu().numpy(), drafted  # the one sync of the verify
        t3 = time.perf_counter()
        # decide every sequence's path first (no state changes: a failure here is its own)
        decided: list[tuple[list[int], int] | Exception] = []
        for seq, tree in zip(seqs, trees, strict=True):
            r0 = seq.cache.slot * w
            try:
                if not top[1, r0 : r0 + tree.size].all():
                    raise EngineError("the target produced non-finite logits (broken weights?)")
                if seq.sampling.greedy:
                    targets = top[0, r0 : r0 + tree.size].tolist()
                else:
                    lg = logits[r0 : r0 + tree.size]
                    if seq.bias is not None:
                        lg = lg + seq.bias
                    targets = target_tokens(lg, seq.sampling, seq.generator).tolist()
                decided.append(self.accept(tree, targets))
            except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the round's
                decided.append(exc)
        # raw log-probs of the tokens each path emits, read at the rows they were chosen at
        # (root + accepted nodes), for the requests that ask; shared, so before any commit
        asking = [
            (seq, tree, d)
            for seq, tree, d in zip(seqs, trees, decided, strict=True)
            if seq.logprobs is not None and not isinstance(d, Exception)
        ]
        round_logprobs = {}
        if asking:
            groups = []
            for seq, tree, (path, bonus) in asking:
                r0 = seq.cache.slot * w
                rows = [r0 + i for i in (0, *path)]
                groups.append(
                    (rows, [tree.tokens[i] for i in path] + [bonus], seq.sampling.logprobs)
                )
            for (seq, _, _), lp in zip(asking, gather_logprobs(logits, groups), strict=True):
                round_logprobs[id(seq)] = lp
        # move the accepted paths' KV (and drafter features) for the whole batch; this writes
        # only pending entries, so if it fails nothing committed has changed
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
            if self.sdraft is not None:  # root + accepted path feed the next draft, after
                # the rows still waiting to be written (budget-0 rounds defer the write)
                src += [slot * w + i for i in keep]
                at = slot * self.sdraft.new_rows + seq.pending
                dst += [at + j for j in range(len(keep))]
        self.pool.move(*moves)
        if src:  # copied out now: the next forward of this shape overwrites `taps`
            dev = taps.device
            feats = self.sdraft.feats.flatten(0, 1)
            feats.index_copy_(
                0,
                torch.tensor(dst, device=dev),
                taps.index_select(0, torch.tensor(src, device=dev)),
            )
        # commit: host state only
        out: list[Outcome] = []
        for seq, tree, d in zip(seqs, trees, decided, strict=True):
            if isinstance(d, Exception):
                seq.finish_reason = "error"
                out.append(d)
                continue
            path, bonus = d
            seq.cache.length += len(path) + 1
            if self.sdraft is not None:
                seq.pending += len(path) + 1
            new = [tree.tokens[i] for i in path] + [bonus]
            new = truncate_at_stop(seq, new, self.eos_token_ids)
            seq.tokens.extend(new)
            seq.output.extend(new)
            if seq.logprobs is not None:
                seq.logprobs.extend(round_logprobs[id(seq)].slice(0, len(new)))
            out.append(new)
        t4 = time.perf_counter()
        tm = self.timing
        tm["rounds"] += 1
        tm["verify_s"] += t3 - t2
        tm["accept_s"] += t4 - t3 + t2 - t1
        for seq, new, tree in zip(seqs, out, trees, strict=True):
            if isinstance(new, Exception):
                continue
            st = seq.stats
            st.draft_tokens += tree.size - 1
            st.draft_s += (t1 - t0) / len(seqs)
            st.verify_s += t4 - t1
            st.verify_rounds += 1
            st.completion_tokens += len(new)
            st.accept_lengths.append(len(new))
        return out

    def draft(self, seq: Sequence, params: LiveParams) -> torch.Tensor | None:
        """Per-depth log-probs [L, V] from a drafter that drafts on its own (not DFlash)."""
        depth = min(self.depth, params.budget)
        if depth <= 0:
            return None
        return self.drafter.draft(seq.draft_state, DraftContext(seq.tokens, params.window), depth)

    def tree_width(self, budget: int, topk: int, depth: int | None = None) -> tuple[int, int]:
        """(verify width, most nodes + 1) of the trees a round of these parameters builds."""
        if depth is None:
            depth = min(self.depth, budget, self.sdraft.block if self.sdraft else budget)
        bound = size_bound(budget, depth, topk) + 1
        return next_bucket(bound, 2, 1 << 30), bound

    def _draft_trees(self, seqs: list[Sequence], params: LiveParams) -> list[Tree] | DeviceTrees:
        t0 = time.perf_counter()
        depth = min(self.depth, params.budget)
        if self.sdraft is None or depth <= 0:
            # budget 0: the drafter's context write waits until a sequence's feature rows
            # would not hold another round's root (or the next draft writes them)
            if self.sdraft is not None and any(s.pending >= self.sdraft.new_rows for s in seqs):
                b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
                self.sdraft.write_only(self._feed_context(seqs, b))
            trees = [
                build_tree(seq.tokens[-1], self.draft(seq, params), params.budget, params.topk)
                for seq in seqs
            ]
            self.timing["draft_s"] += time.perf_counter() - t0
            return trees
        sd = self.sdraft
        depth = min(depth, sd.block)
        b = next_bucket(self.pool.used_rows, 1, self.pool.slots)
        q, ml = depth + 1, self.pool.max_len
        cwpos = self._feed_context(seqs, b)
        root = np.zeros(b, dtype=np.int64)
        bwpos = np.tile(np.arange(ml - q, ml), (b, 1))
        bpos = np.zeros((b, q), dtype=np.int64)
        lens = np.zeros(b, dtype=np.int64)
        window = np.full(b, ml, dtype=np.int64)
        longest = 0
        for seq in seqs:
            s, root_pos = seq.cache.slot, seq.draft_state
            root[s] = seq.tokens[-1]
            bwpos[s] = bpos[s] = root_pos + np.arange(q)
            lens[s], window[s] = root_pos, params.window
            longest = max(longest, root_pos + q)
        packed = pack_draft(cwpos, root, bwpos, bpos, lens, window)
        ctx = self.target.ctx_bucket(longest)
        if self.device_tree:  # the trees on the GPU, left there for the verify
            width, bound = self.tree_width(params.budget, params.topk, depth)
            key = (b, depth, ctx, params.topk, params.budget, width)
            out = sd.forward(packed, key)
            self.timing["draft_s"] += time.perf_counter() - t0
            return DeviceTrees(*out, width, bound)
        key = (b, depth, ctx, next_bucket(params.topk, 1, MAX_TOPK))
        top = sd.forward(packed, key).cpu().numpy()
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

    def _feed_context(self, seqs: list[Sequence], b: int) -> np.ndarray:
        """Where each sequence's pending feature rows go in the drafter's pool (context write
        positions [B, new_rows], unused rows to the guard entries); advances draft_state."""
        wn, ml = self.sdraft.new_rows, self.pool.max_len
        cwpos = np.tile(np.arange(ml - wn, ml), (b, 1))
        for seq in seqs:
            self._catch_up(seq)
            s, start, n = seq.cache.slot, seq.draft_state, seq.pending
            cwpos[s, :n] = start + np.arange(n)
            seq.draft_state, seq.pending = start + n, 0
            if seq.draft_state != len(seq.tokens) - 1:
                raise EngineError(
                    f"DFlash context covers {seq.draft_state} tokens, expected {len(seq.tokens) - 1}"
                )
        return cwpos

    def _catch_up(self, seq: Sequence) -> None:
        """A prompt's context rows (more than one round's), written eagerly after prefill."""
        if seq.hidden_new:
            taps = torch.cat(seq.hidden_new)
            seq.hidden_new.clear()
            self.sdraft.extend(seq.cache.slot, seq.draft_state, taps)
            seq.draft_state += taps.shape[0]
