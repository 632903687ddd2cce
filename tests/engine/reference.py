"""The test oracle: the DDTree algorithm written plainly over growable per-request KV
caches (`Llama.forward_batch`), one function per step. The engine
(`ddserve.engine.static_engine.StaticEngine`) must match it token for token: same drafts,
trees, accept rule, outputs and accept lengths.

    prefill  the prompt (all but its last token) into the target's KV cache
    per round:
      draft       drafter -> per-depth log-probs [L, V] over the windowed context
      build_tree  best-first tree of `budget` nodes (ddserve.engine.tree)
      verify      one target forward over [root + nodes] with the tree mask
      accept      target token at every node (argmax or a sample of the logits plus the
                  request's logit_bias); walk while it is a child; first miss = bonus
      commit      keep the KV of root + accepted path; the bonus becomes the next root;
                  raw log-probs (log_softmax of the unbiased logits) of the emitted tokens
                  at the rows they were chosen at, when the request asks

`budget=0` (or no draft) verifies the root alone: plain autoregressive decoding through the
same code. Parameters are read once per round, so a live change is atomic per round.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import DFlashDrafter
from ddserve.engine.drafters import DraftContext, Drafter
from ddserve.engine.llama import Llama, linear
from ddserve.engine.sampling import Logprobs, SamplingParams, target_tokens
from ddserve.engine.sequence import Outcome, Sequence, truncate_at_stop
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.tree import Tree, accept, build_tree, tree_mask
from ddserve.errors import EngineError


class ReferenceEngine:
    """The algorithm over one target model and one drafter; no threads, no I/O."""

    def __init__(self, model: Llama, drafter: Drafter, depth: int, eos_token_ids: tuple[int, ...]):
        self.model = model
        self.drafter = drafter
        self.depth = depth
        self.eos_token_ids = frozenset(eos_token_ids)
        # target layers whose outputs the drafter is conditioned on (kept from verify)
        self.capture: tuple[int, ...] = tuple(getattr(drafter, "capture", ()))

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
        if sampling.logit_bias:
            seq.bias = torch.zeros(self.model.cfg.vocab_size, device=self.model.device)
            for t, b in sampling.logit_bias:
                seq.bias[t] = b
        if sampling.logprobs is not None:
            seq.logprobs = Logprobs()
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
        if depth > 0 and isinstance(self.drafter, DFlashDrafter):
            depth = self.depth  # a block drafter drafts its whole block whatever the budget
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

    def accept_one(self, seq: Sequence, tree: Tree, logits: torch.Tensor) -> list[int]:
        """Target tokens, accept and commit for one sequence: its new tokens."""
        # logits: [n+1, V]
        if not torch.isfinite(logits).all():
            raise EngineError("the target produced non-finite logits (broken weights?)")
        biased = logits if seq.bias is None else logits + seq.bias
        targets = target_tokens(biased, seq.sampling, seq.generator).tolist()
        path, bonus = self.accept(tree, targets)
        new = self.commit(seq, tree, path, bonus)
        if seq.logprobs is not None:
            lp = torch.log_softmax(logits[[0, *path][: len(new)]].float(), dim=-1)
            top = lp.topk(min(seq.sampling.logprobs, lp.shape[-1]), dim=-1)
            seq.logprobs.extend(
                Logprobs(
                    [lp[i, t].item() for i, t in enumerate(new)],
                    top.indices.tolist(),
                    top.values.tolist(),
                )
            )
        return new

    @torch.inference_mode()
    def step_batch(self, seqs: list[Sequence], params: LiveParams) -> list[Outcome]:
        """The contract of `StaticEngine.step_batch`: draft and build each tree, verify all
        trees in one target forward (packed, each under its own mask over its own cache),
        then accept and commit per sequence."""
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

    # the request loop is the engine's own (one round at a time until finished)
    step = StaticEngine.step
    generate = StaticEngine.generate


TIE = 1e-4  # path log-weights this close are a tie that float rounding may break either way


class Draft:
    """A verified tree as recorded: node tokens and path log-weights, in the order the
    best-first build made them (descending weight). Two are equal when their roots and weight
    sequences agree (within TIE) and, within each run of tied weights, they hold the same
    tokens: two implementations of the same drafter (other kernels, other float rounding) may
    take tied candidates in either order, and with them their parents. The last run is the
    exception: there the budget may cut between tied candidates, keeping a different one."""

    def __init__(self, tokens: list[int], logws: list[float]):
        self.tokens, self.logws = list(tokens), list(logws)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Draft({self.tokens})"

    def _runs(self) -> list[tuple[int, int]]:
        """[start, end) of each run of consecutive nodes whose weights tie."""
        runs, start = [], 0
        for i in range(1, len(self.logws) + 1):
            if i == len(self.logws) or abs(self.logws[i] - self.logws[start]) > TIE:
                runs.append((start, i))
                start = i
        return runs

    def __eq__(self, other) -> bool:
        if not isinstance(other, Draft) or len(self) != len(other):
            return False
        if any(abs(a - b) > TIE for a, b in zip(self.logws, other.logws, strict=True)):
            return False
        runs = self._runs()
        return self.tokens[:1] == other.tokens[:1] and all(
            sorted(self.tokens[a:b]) == sorted(other.tokens[a:b]) for a, b in runs[:-1]
        )


def record_trees(engine) -> list[Draft]:
    """Every tree `engine` verifies from now on, through its tree seam: two engines that
    must draft alike are compared draft for draft (`Draft`: up to the order of tied nodes)."""
    trees: list[Draft] = []
    if hasattr(engine, "on_trees"):  # the static engine walks a round's trees at once
        engine.on_trees = lambda ts: trees.extend(Draft(t.tokens, t.node_logws) for t in ts)
        return trees

    def recording(tree, targets):
        trees.append(Draft(tree.tokens, tree.node_logws))
        return accept(tree, targets)

    engine.accept = recording
    return trees


def runner_together_and_alone(runner, n: int, max_tokens: int) -> tuple[list, list]:
    """Prompts [1, 5 + i, 9] for i < n through a started EngineRunner, all at once and then
    one at a time (`max_tokens` each, ignore_eos): the tokens each got, (together, alone)."""

    async def one(p):
        out = []
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for step in runner.generate(p, sp):
            out += step.token_ids
        return out

    async def main():
        together = await asyncio.gather(*(one([1, 5 + i, 9]) for i in range(n)))
        alone = [await one([1, 5 + i, 9]) for i in range(n)]
        return list(together), alone

    return asyncio.run(main())


def decode_with_late_joiner(eng, prompts, params, max_tokens: int) -> list[tuple]:
    """All but the last of `prompts` prefilled in one batch and decoded together, the last
    joining after one round; every sequence to its end (greedy, `max_tokens` each). Returns
    (output, accept lengths) per prompt: two engines that must decode alike compare these."""
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    eng.prefill_batch(seqs[:-1])
    eng.step_batch(seqs[:-1], params)
    eng.prefill(seqs[-1])  # joins late
    while not all(s.finished for s in seqs):
        eng.step_batch([s for s in seqs if not s.finished], params)
    return [(s.output, s.stats.accept_lengths) for s in seqs]


def one_engine(
    model: Llama, drafter: Drafter, depth: int, eos_token_ids=(), engine=StaticEngine, **kw
) -> StaticEngine:
    """The engine under test (or a subclass), on the model's device, with room for the
    tests' batches."""
    kw.setdefault("slots", 8)
    kw.setdefault("max_context", 512)
    kw.setdefault("graphs", False)
    return engine(model, drafter, depth, tuple(eos_token_ids), **kw)


@dataclass
class _DFlashState:
    keys: list[torch.Tensor] | None = None  # per layer [1, kvh, n, hd], positions start..start+n
    values: list[torch.Tensor] | None = None
    start: int = 0  # absolute position of the first cached context entry
    length: int = 0


class ReferenceDFlash(DFlashDrafter):
    """The DFlash drafter written plainly: one request at a time over growable per-layer
    context keys/values (the engine's `StaticDFlash` must draft the same)."""

    def new_state(self) -> _DFlashState:
        return _DFlashState()

    @torch.inference_mode()
    def draft(self, state: _DFlashState, ctx: DraftContext, depth: int) -> torch.Tensor:
        dev, d = self.target.device, self.net
        root_pos = len(ctx.tokens) - 1
        if ctx.target_hidden is not None and ctx.target_hidden.shape[0]:
            self._extend(state, ctx.target_hidden)
        if state.start + state.length != root_pos:
            raise EngineError(
                f"DFlash context covers {state.start + state.length} tokens, expected {root_pos}"
            )
        self._evict(state, max(0, state.length - ctx.window))
        depth = min(depth, self.block_size)
        emb = self.target.embed_tokens(torch.tensor([ctx.tokens[-1]], device=dev))
        block = torch.cat([emb, d.mask_embedding.to(emb.dtype).expand(depth, -1)])[None]
        pos = torch.arange(root_pos, root_pos + depth + 1, device=dev)[None]
        kv = list(zip(state.keys, state.values, strict=True)) if state.keys else None
        if kv is None:  # empty context: zero-length keys
            c = d.c
            empty = block.new_zeros(1, c.num_kv_heads, 0, c.head_dim)
            kv = [(empty, empty)] * c.num_layers
        hidden = d.blocks(block, pos, kv)[0, 1:]  # [depth, H]
        logp = torch.log_softmax(linear(hidden, self.head).float(), dim=-1).cpu()
        if self.vocab is None:
            return logp
        out = torch.full((depth, self.target.cfg.vocab_size), float("-inf"))
        out[:, self.vocab] = logp
        return out

    def _extend(self, state: _DFlashState, taps: torch.Tensor) -> None:
        n = taps.shape[0]
        first = state.start + state.length
        pos = torch.arange(first, first + n, device=taps.device)[None]
        new = self.net.context_kv(self.net.project(taps.to(self.target.dtype))[None], pos)
        if state.keys is None:
            state.keys = [k for k, _ in new]
            state.values = [v for _, v in new]
        else:
            state.keys = [
                torch.cat([a, k], dim=2) for a, (k, _) in zip(state.keys, new, strict=True)
            ]
            state.values = [
                torch.cat([a, v], dim=2) for a, (_, v) in zip(state.values, new, strict=True)
            ]
        state.length += n

    @staticmethod
    def _evict(state: _DFlashState, n: int) -> None:
        if n <= 0:
            return
        state.keys = [k[:, :, n:] for k in state.keys]
        state.values = [v[:, :, n:] for v in state.values]
        state.start += n
        state.length -= n
