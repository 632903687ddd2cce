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
ddserve.engine.static_accept, one round (draft, verify, accept, commit) in
ddserve.engine.static_round, several back to back in ddserve.engine.static_steps (plain
steps) and ddserve.engine.static_spec (DDTree rounds on the device): mixins of StaticEngine;
this module is the engine's state, its requests' lifecycle and the round's dispatch.
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
    SamplingParams,
    bias_vector,
)
from ddserve.engine.sequence import Outcome, Sequence
from ddserve.engine.static import (
    SlotCache,
    compile_layer_step,
    fused_layers_on,
    layer_step,
)
from ddserve.engine.static_accept import Accepting
from ddserve.engine.static_dflash import StaticDFlash
from ddserve.engine.static_draft import Drafting
from ddserve.engine.static_models import StaticTarget, slots_that_fit
from ddserve.engine.static_prefill import (
    PREFILL_CHUNKS,
    PREFILL_CHUNKS_LONG,
    Prefill,
    fresh_chunks,
)
from ddserve.engine.static_round import OneRound
from ddserve.engine.static_spec import SpecSteps, spec_glue
from ddserve.engine.static_startup import StartUp
from ddserve.engine.static_steps import Steps
from ddserve.errors import EngineError

log = logging.getLogger(__name__)

# whether the DFlash drafter's block runs through the fused layer kernels where the target's
# verify does (benchmarks' switch: `bench.tuned` {"engine": {"DRAFT_FUSED_LAYERS": true}})
DRAFT_FUSED_LAYERS = False


class StaticEngine(Prefill, StartUp, Drafting, Accepting, OneRound, Steps, SpecSteps):
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
        return self._one_round(seqs, params)
