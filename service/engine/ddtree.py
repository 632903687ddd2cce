"""One request's DDTree decoding, one round at a time.

    prefill  the prompt (all but its last token) into the target's KV cache
    per round:
      draft       drafter -> per-depth log-probs [L, V] over the windowed context
      build_tree  best-first tree of `budget` nodes (ddserve.engine.tree)
      verify      one target forward over [root + nodes] with the tree mask
      accept      target token at every node; walk while it is a child; first miss = bonus
      commit      keep the KV of root + accepted path; the bonus becomes the next root

`budget=0` (or no draft) verifies the root alone: plain autoregressive decoding through the
same code. Parameters are read once per round, so a live change is atomic per round.
"""

from __future__ import annotations

import secrets
import time

import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.drafters import DraftContext, Drafter
from ddserve.engine.llama import Llama
from ddserve.engine.sampling import SamplingParams, target_tokens
from ddserve.engine.sequence import Outcome, Sequence, truncate_at_stop
from ddserve.engine.tree import Tree, accept, build_tree, tree_mask
from ddserve.errors import EngineError


class DDTreeEngine:
    """The algorithm over one target model and one drafter; no threads, no I/O."""

    def __init__(self, model: Llama, drafter: Drafter, depth: int, eos_token_ids: tuple[int, ...]):
        self.model = model
        self.drafter = drafter
        self.depth = depth
        self.eos_token_ids = frozenset(eos_token_ids)
        # target layers whose outputs the drafter is conditioned on (kept from verify)
        self.capture: tuple[int, ...] = tuple(getattr(drafter, "capture", ()))

    free_slots: int | None = None  # no fixed number of concurrent sequences
    accept = staticmethod(accept)  # the accept rule (ddserve.engine.tree); a test seam

    def release(self, seq: Sequence) -> None:
        """The sequence is done (finished, failed or cancelled); its caches can go."""

    def new_sequence(self, prompt: list[int], sampling: SamplingParams) -> Sequence:
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))
        cache = self.model.new_cache(capacity=max(64, len(prompt) + 64))
        seq = Sequence(
            list(prompt), sampling, cache, self.drafter.new_state(), gen, tokens=list(prompt)
        )
        seq.stats.prompt_tokens = len(prompt)
        return seq

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        head = seq.tokens[:-1]
        if head:
            dev = self.model.device
            out = self.model(
                torch.tensor(head, device=dev),
                torch.arange(len(head), device=dev),
                seq.cache,
                last_only=True,
                capture=self.capture,
            )
            if self.capture:
                seq.hidden_new.append(out[1])
            seq.cache.commit(len(head))
        seq.stats.prefill_s += time.perf_counter() - t0

    def prefill_batch(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.prefill(seq)

    def draft(self, seq: Sequence, params: LiveParams) -> torch.Tensor | None:
        depth = min(self.depth, params.budget)
        if depth <= 0:
            return None
        hidden = None
        if seq.hidden_new:
            hidden = torch.cat(seq.hidden_new) if len(seq.hidden_new) > 1 else seq.hidden_new[0]
            seq.hidden_new.clear()
        ctx = DraftContext(seq.tokens, params.window, hidden)
        return self.drafter.draft(seq.draft_state, ctx, depth)

    def verify(self, seqs: list[Sequence], trees: list[Tree]) -> list[torch.Tensor]:
        """One target forward over every sequence's tree (packed; each sees its own cache
        under its own tree mask): logits at every node [n_i+1, V] per sequence; their KV
        become pending cache entries. A capturing drafter's tapped layer outputs go to
        `seq.tree_hidden`."""
        dev = self.model.device
        toks = [torch.tensor(t.tokens, device=dev) for t in trees]
        pos = [
            s.cache.next_pos + torch.tensor(t.depths, device=dev)
            for s, t in zip(seqs, trees, strict=True)
        ]
        masks = [tree_mask(t, dev) for t in trees]
        logits, hidden = self.model.forward_batch(
            toks, pos, [s.cache for s in seqs], masks, capture=self.capture
        )
        if hidden is not None:
            for seq, h in zip(seqs, hidden, strict=True):
                seq.tree_hidden = h
        return logits

    def commit(self, seq: Sequence, tree: Tree, path: list[int], bonus: int) -> list[int]:
        seq.cache.commit([0, *path])
        if self.capture:
            seq.hidden_new.append(seq.tree_hidden[[0, *path]])
            seq.tree_hidden = None
        new = [tree.tokens[i] for i in path] + [bonus]
        new = truncate_at_stop(seq, new, self.eos_token_ids)
        seq.tokens.extend(new)
        seq.output.extend(new)
        return new

    @torch.inference_mode()
    def step(self, seq: Sequence, params: LiveParams) -> list[int]:
        """One round of one sequence (see `step_batch`). Returns its new tokens."""
        out = self.step_batch([seq], params)[0]
        if isinstance(out, Exception):
            raise out
        return out

    def accept_one(self, seq: Sequence, tree: Tree, logits: torch.Tensor) -> list[int]:
        """Target tokens, accept and commit for one sequence: its new tokens."""
        # logits: [n+1, V]
        if not torch.isfinite(logits).all():
            raise EngineError("the target produced non-finite logits (broken weights?)")
        targets = target_tokens(logits, seq.sampling, seq.generator).tolist()
        path, bonus = self.accept(tree, targets)
        return self.commit(seq, tree, path, bonus)

    @torch.inference_mode()
    def step_batch(self, seqs: list[Sequence], params: LiveParams) -> list[Outcome]:
        """One round of every sequence: draft and build each tree, verify all trees in one
        target forward, then accept and commit per sequence.

        Atomic per round: if the shared part (drafts, verify) raises, nothing was committed
        and the caller may retry. After it, each sequence's outcome is its own: its new
        tokens, or the exception that ended it (its commit did not happen; the others' did).
        Per-request stats: its own draft time, and the shared verify's wall time."""
        trees, draft_s = [], []
        for seq in seqs:
            t0 = time.perf_counter()
            logprobs = self.draft(seq, params)
            trees.append(build_tree(seq.tokens[-1], logprobs, params.budget, params.topk))
            draft_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        logits = self.verify(seqs, trees)
        out: list[Outcome] = []
        for seq, tree, lg in zip(seqs, trees, logits, strict=True):
            try:
                out.append(self.accept_one(seq, tree, lg))
            except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the round's
                seq.finish_reason = "error"
                out.append(exc)
        t2 = time.perf_counter()
        for seq, new, d in zip(seqs, out, draft_s, strict=True):
            if isinstance(new, Exception):
                continue
            st = seq.stats
            st.draft_s += d
            st.verify_s += t2 - t1
            st.verify_rounds += 1
            st.completion_tokens += len(new)
            st.accept_lengths.append(len(new))
        return out

    def generate(self, prompt: list[int], sampling: SamplingParams, params: LiveParams) -> Sequence:
        """Run one request to completion (tests, benchmarks; the server uses `step`)."""
        seq = self.new_sequence(prompt, sampling)
        try:
            self.prefill(seq)
            while not seq.finished:
                self.step(seq, params)
        finally:
            self.release(seq)
        return seq
