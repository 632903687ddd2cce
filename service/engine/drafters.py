"""Drafters: per-depth log-probabilities [L, V] for the L positions after the context.

Interface (`Drafter`): `new_state()` makes per-request state; `draft(state, ctx, depth)`
returns log-probs [L, V] (rows may be all -inf where the drafter has nothing to propose) or
None. `ctx.tokens` is the committed context ending with the root token; `ctx.window` bounds
what the drafter attends to. `ctx.target_hidden` is reserved for a DFlash-style block
drafter conditioned on the target's hidden states (one forward -> L marginals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ddserve.engine.llama import KVCache, Llama


@dataclass
class DraftContext:
    tokens: list[int]  # committed tokens, the last one is the tree root
    window: int
    target_hidden: torch.Tensor | None = None


class Drafter(Protocol):
    name: str

    def new_state(self) -> object: ...

    def draft(self, state: object, ctx: DraftContext, depth: int) -> torch.Tensor | None: ...


class NoDrafter:
    """Autoregressive decoding: no draft, every round verifies the root alone."""

    name = "none"

    def new_state(self) -> None:
        return None

    def draft(self, state, ctx: DraftContext, depth: int) -> None:
        return None


class NGramDrafter:
    """Prompt lookup: match the context's last n tokens (n = max_n..min_n) earlier in the
    context and vote for what followed, per depth. Longer and more recent matches weigh
    more; unseen tokens get -inf, so the tree only branches where the text repeats."""

    name = "ngram"

    def __init__(self, vocab_size: int, max_n: int = 4, min_n: int = 1, max_matches: int = 32):
        self.vocab_size = vocab_size
        self.max_n, self.min_n, self.max_matches = max_n, min_n, max_matches

    def new_state(self) -> None:
        return None

    def draft(self, state, ctx: DraftContext, depth: int) -> torch.Tensor | None:
        seq = np.asarray(ctx.tokens[-ctx.window :], dtype=np.int64)
        votes = [dict() for _ in range(depth)]  # per depth: token -> weight
        total = np.zeros(depth)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            starts = self._match_starts(seq, n)
            if starts.size == 0:
                continue
            for rank, s in enumerate(starts[::-1][: self.max_matches]):  # most recent first
                w = float(2**n) / (1.0 + 0.1 * rank)
                cont = seq[s + n : s + n + depth]
                for d, tok in enumerate(cont.tolist()):
                    votes[d][tok] = votes[d].get(tok, 0.0) + w
                    total[d] += w
            if starts.size >= 4:
                break  # enough evidence at this length; shorter suffixes only add noise
        if total[0] == 0:
            return None
        out = torch.full((depth, self.vocab_size), float("-inf"))
        for d in range(depth):
            if not votes[d]:
                break
            # mass for "something unseen" keeps confidence honest for sparse evidence
            denom = total[d] + 2.0**self.min_n
            toks = torch.tensor(list(votes[d].keys()))
            out[d, toks] = torch.log(torch.tensor(list(votes[d].values())) / denom).float()
        return out

    @staticmethod
    def _match_starts(seq: np.ndarray, n: int) -> np.ndarray:
        """Start indices i < len-n with seq[i:i+n] == seq[-n:] (a continuation exists)."""
        m = len(seq) - n  # candidate starts 0..m-1 leave at least one following token
        if m <= 0:
            return np.empty(0, dtype=np.int64)
        hit = np.ones(m, dtype=bool)
        suffix = seq[-n:]
        for j in range(n):
            hit &= seq[j : j + m] == suffix[j]
        return np.nonzero(hit)[0]


@dataclass
class _ModelDraftState:
    cache: KVCache
    cached: list[int]  # tokens whose KV is in the cache, from absolute position cache.start_pos


class ModelDrafter:
    """A causal LM with the target's tokenizer rolled out greedily `depth` steps; its
    distribution at each step is that depth's marginal. With `num_layers` it runs only the
    first layers (+ final norm + LM head): the layer-skip drafter over the target's weights."""

    def __init__(self, model: Llama, num_layers: int | None = None, name: str = "draft-model"):
        self.model = model
        self.num_layers = num_layers
        self.name = name

    def new_state(self) -> _ModelDraftState:
        return _ModelDraftState(self.model.new_cache(num_layers=self.num_layers), [])

    def draft(self, state: _ModelDraftState, ctx: DraftContext, depth: int) -> torch.Tensor:
        cache, dev = state.cache, self.model.device
        # keep the cached tokens that still agree with the context; drop the old rollout
        base = cache.start_pos
        common = 0
        limit = min(len(state.cached), len(ctx.tokens) - base)
        while common < limit and state.cached[common] == ctx.tokens[base + common]:
            common += 1
        cache.truncate(common)
        del state.cached[common:]
        # sliding window: at most `window` context entries stay visible
        overflow = cache.length + (len(ctx.tokens) - base - common) - ctx.window
        if overflow > 0:
            cache.evict_front(overflow)
            del state.cached[:overflow]
            base, common = cache.start_pos, cache.length
            if len(ctx.tokens) - base - common > ctx.window:
                cache.evict_front(cache.length)
                state.cached.clear()
                base = cache.start_pos = len(ctx.tokens) - ctx.window
                common = 0
        if base + common == len(ctx.tokens):  # all cached: re-feed the root for its logits
            common -= 1
            cache.truncate(common)
            del state.cached[common:]
        new = ctx.tokens[base + common :]
        rows = []
        for _ in range(depth):
            toks = torch.tensor(new, device=dev)
            pos = torch.arange(cache.next_pos, cache.next_pos + len(new), device=dev)
            logits = self.model(toks, pos, cache, num_layers=self.num_layers, last_only=True)
            cache.commit(len(new))
            state.cached.extend(new)
            lp = torch.log_softmax(logits[-1].float(), dim=-1)  # [V]
            rows.append(lp)
            new = [int(lp.argmax())]
        return torch.stack(rows).cpu()  # [L, V]
