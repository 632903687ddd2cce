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
  * argmax and the finiteness check inside the graph, and every sampled request's tokens
    drawn at once on the device (ddserve.engine.sampling.sample_rows: per-request
    parameters, bias and generator): one device->host copy per verify;
    accepted paths move in the pool with one gather/scatter for the whole batch
  * logit_bias: added to the target's logits at every node of a biased request's tree
    (outside the graph, only when a request of the round has one), before its tokens are
    chosen, so speculation stays lossless under the bias
  * raw log-probs of the emitted tokens from the verify's own logits at the accepted
    path's rows (root + accepted nodes: the rows the emitted tokens were chosen at), only
    for requests that ask, one device->host copy per round for all of them

Prefill lives in ddserve.engine.static_prefill, warm-up and round times in
ddserve.engine.static_startup, the draft step in
ddserve.engine.static_draft, the accept walk and the moves it implies in
ddserve.engine.static_accept (mixins of StaticEngine); this module is the round itself.
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

from ddserve.config.engine import LiveParams
from ddserve.engine.attention import backend as attention_backend
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import Drafter, NoDrafter
from ddserve.engine.graphs import GraphCache
from ddserve.engine.llama import Llama
from ddserve.engine.sampling import (
    BatchSampler,
    Logprobs,
    SampleGroup,
    SamplingParams,
    bias_vector,
    gather_logprobs,
)
from ddserve.engine.sequence import Outcome, Sequence, truncate_at_stop
from ddserve.engine.static import (
    SlotCache,
    compile_layer_step,
    fused_layers_on,
    layer_step,
    next_bucket,
)
from ddserve.engine.static_accept import Accepting
from ddserve.engine.static_dflash import StaticDFlash
from ddserve.engine.static_draft import Drafting
from ddserve.engine.static_models import StaticTarget, pack_target, slots_that_fit
from ddserve.engine.static_prefill import (
    PREFILL_CHUNKS,
    PREFILL_CHUNKS_LONG,
    Prefill,
    fresh_chunks,
)
from ddserve.engine.static_spec import SpecSteps, spec_glue
from ddserve.engine.static_startup import StartUp
from ddserve.engine.static_steps import Steps
from ddserve.engine.tree import DeviceTrees, ancestor_mask
from ddserve.errors import EngineError

log = logging.getLogger(__name__)

# whether the DFlash drafter's block runs through the fused layer kernels where the target's
# verify does (benchmarks' switch: `bench.tuned` {"engine": {"DRAFT_FUSED_LAYERS": true}})
DRAFT_FUSED_LAYERS = False


class StaticEngine(Prefill, StartUp, Drafting, Accepting, Steps, SpecSteps):
    """The algorithm over one target model and one drafter; no threads, no I/O. `slots`
    requests at a time, each up to `max_context` tokens; `graphs` applies only on CUDA,
    `compile` wherever asked (the runner asks on CUDA)."""

    on_trees = None  # a test's seam: each one-round call's trees (Tree objects) as verified

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
        fused_layers: str = "auto",
        scheduler_steps: int = 1,
    ):
        self.model = model
        # steps a round of an engine without a drafter takes (static_steps; vLLM's
        # --num-scheduler-steps): its default, the runner's is per round (`step_batch`)
        self.scheduler_steps = scheduler_steps
        self.round_steps = 1  # the steps the last round took
        self.drafter = drafter
        self.depth = depth
        self.eos_token_ids = frozenset(eos_token_ids)
        # target layers whose outputs the drafter is conditioned on (kept from verify)
        self.capture: tuple[int, ...] = tuple(getattr(drafter, "capture", ()))
        graphs = graphs and model.device.type == "cuda"
        if memory_fraction is not None and model.device.type == "cuda":
            slots = slots_that_fit(model, drafter, slots, max_context, memory_fraction)
        base_fn = compile_layer_step() if compile else layer_step  # the hot step, compiled once
        layer_fn = base_fn
        self.fused_layers = fused_layers_on(fused_layers, model.device, model.dtype)
        if self.fused_layers:  # the target's decode/verify widths: four triton kernels a layer
            from ddserve.engine.layer_triton import with_fused_layers

            layer_fn = with_fused_layers(base_fn)
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
            compiled=compile,
        )
        self.pool = self.target.pool
        # a prompt's first chunk under graphs: up to the pool's width (attention.FRESH); with
        # triton, whose widest other chunks already hold as many tokens (the sdpa reference
        # keeps its narrow chunks and the activation memory they need)
        fresh = self.target.graphs.enabled and self.attention == "triton"
        self.fresh_chunks = fresh_chunks(self.pool.max_len, self.pool.usable) if fresh else ()
        self.sdraft = None
        if isinstance(drafter, DFlashDrafter):
            self.sdraft = StaticDFlash(
                drafter,
                self.pool.slots,
                self.pool.max_len,
                self.pool.guard,
                graphs,
                # not fused (DRAFT_FUSED_LAYERS): on the H200 its two-layer block drafted
                # slower so (0.27 vs 0.21 ms a round, bench/NOTES.md), where the target's AR
                # step gained 10%
                layer_fn=layer_fn if DRAFT_FUSED_LAYERS else base_fn,
                attention=self.attention,
                compiled=compile,
            )
        # DFlash trees built on the GPU (ddserve.engine.tree_triton) where triton kernels run:
        # auto = with CUDA and triton; True off CUDA only under TRITON_INTERPRET (the tests)
        if device_tree is None:
            device_tree = (
                model.device.type == "cuda" and attention_backend("auto", model.device) == "triton"
            )
        self.device_tree = (
            bool(device_tree) and self.sdraft is not None and self._tree_kernel_runs()
        )
        # sampled requests' rows, all at once (inputs staged like the verify's: no sync)
        self.sampler = BatchSampler(self.pool.slots * self.pool.guard, self.target.staging)
        self._side, self._launched = None, None  # the overlapped prefill's stream, its run
        # several DDTree rounds a host round trip (static_spec): their glue's graphs, buffers
        self.spec_graphs, self._spec = GraphCache(graphs, "spec"), {}
        self._feed = None  # budget-0 plain steps' feature-row indices (static_steps)
        self.spec_glue = spec_glue(compile)
        # rounds: forward rounds; trips: calls of step_batch that ran them (host round trips,
        # several rounds each with num_scheduler_steps)
        self.timing = {"rounds": 0, "trips": 0, "draft_s": 0.0, "tree_s": 0.0}
        self.timing.update(verify_s=0.0, accept_s=0.0)

    def _tree_kernel_runs(self) -> bool:
        """Build one tiny tree with the kernel (it compiles here); if it cannot run on this
        device, trees are built on the host (logged): correct, only slower."""
        from ddserve.engine.tree_triton import build_trees

        dev = self.model.device
        five = torch.full((1,), 5, dtype=torch.long, device=dev)
        try:
            lp = torch.zeros(1, 1, 1, dtype=torch.float64, device=dev)
            out = build_trees(lp, five[:, None, None] + 2, five, five, 1, 1, 2)
            tok, pos, par = (t.tolist() for t in out[:3])
            ok = tok == [[5, 7]] and pos == [[5, 6]] and par == [[-1, 0]]
        except Exception as exc:  # noqa: BLE001 - any kernel failure: host trees
            log.warning("the GPU tree build does not run here (%s); trees built on the host", exc)
            return False
        if not ok:
            log.warning("the GPU tree build gave a wrong tree; trees built on the host")
        return ok

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
    def step_batch(
        self, seqs: list[Sequence], params: LiveParams, steps: int | None = None
    ) -> list[Outcome]:
        """One round of every sequence: draft and build each tree, verify all trees in one
        target forward, then accept and commit per sequence. `steps` (default: the
        engine's `scheduler_steps`) where no sequence asks for log-probs: without a drafter
        (or a DFlash drafter at budget 0) that many one-token steps back to back on the
        device (ddserve.engine.static_steps);
        with DFlash trees built on the GPU that many rounds (ddserve.engine.static_spec).

        Atomic per round: if the shared part (drafts, verify) raises, nothing was committed
        and the caller may retry. After it, each sequence's outcome is its own: its new
        tokens, or the exception that ended it (its commit did not happen; the others' did).
        Per-request stats: its share of the draft time, and the verify's wall time."""
        steps = self.scheduler_steps if steps is None else steps
        if steps > 1 and all(seq.logprobs is None for seq in seqs):
            plain = self.sdraft is not None and self.block_depth(params.budget) <= 0
            if plain or isinstance(self.drafter, NoDrafter):  # one token a request a step
                return self._steps_round(seqs, steps)
            if (out := self._spec_rounds(seqs, params, steps)) is not None:
                return out
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
