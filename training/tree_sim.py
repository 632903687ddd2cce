"""Greedy DDTree rounds simulated on the target's own answers: the tau a drafter would reach
in the engine, without the engine (training's eval and `python -m ddserve.bench.tree_tau`).

The target's greedy answer fixes every round: the engine's drafter sees the committed tokens'
target features (teacher forcing is exact here: the committed tokens are the target's own),
so one drafter forward over all of an answer's root positions gives every distribution a
round can meet. A round builds the best-first tree at its root (the order of
ddserve.engine.tree.build_tree_top), accepts the longest tree path that spells the answer's
next tokens, and emits those plus the target's bonus token; the next round's root follows.
tau = tokens / rounds, as the engine reports it.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

# configurations the training eval reports: (budget, top-k), those the bench measures
EVAL_TREES = ((8, 2), (16, 4), (32, 4))


@torch.inference_mode()
def root_tops(
    hidden: torch.Tensor,
    head: torch.Tensor,
    k: int,
    vocab: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's block outputs at every root position of one answer [A, L, H] (from
    `ddserve.training.dflash_blocks.block_forward`, anchors plen - 1 .. T - 2) -> its top-k
    log-probs and token ids per depth, float64 / int64 arrays [A, L, k]. `head`: the LM head
    rows the drafter proposes, `vocab` their token ids (None: the whole vocabulary)."""
    logits = hidden.float() @ head.float().T  # (the engine's CUDA draft: bf16 products)
    lp = torch.log_softmax(logits / temperature, dim=-1)
    v, i = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    if vocab is not None:
        i = vocab.to(i.device)[i]
    return v.double().cpu().numpy(), i.cpu().numpy()


def build(lp: np.ndarray, ids: np.ndarray, budget: int, k: int, lam: float = 1.0):
    """The best-first tree over one root's [L, K] log-probs and ids, `build_tree_top`'s
    order and ties; a node weighs its log-prob + `lam` x its parent's weight (1: the sum
    along the path, the engine's). Returns (tokens, parents), node 0 the root (token -1)."""
    k = min(k, lp.shape[1])  # fewer candidates than asked (a small vocabulary): only those
    toks, pars, logw = [-1], [-1], [0.0]
    if budget <= 0 or not lp[0, 0] > -math.inf:
        return toks, pars
    heap = [(-lp[0, 0], 0, 1, 0, 0)]
    tie = 1
    depth_limit = lp.shape[0]
    while heap and len(toks) - 1 < budget:
        neg, _, d, r, p = heapq.heappop(heap)
        node = len(toks)
        toks.append(int(ids[d - 1, r]))
        pars.append(p)
        logw.append(-neg)
        if r + 1 < k and lp[d - 1, r + 1] > -math.inf:
            heapq.heappush(heap, (-(lam * logw[p] + lp[d - 1, r + 1]), tie, d, r + 1, p))
            tie += 1
        if d < depth_limit and lp[d, 0] > -math.inf:
            heapq.heappush(heap, (-(lam * logw[node] + lp[d, 0]), tie, d + 1, 0, node))
            tie += 1
    return toks, pars


def accepted(toks: list[int], pars: list[int], want) -> int:
    """Drafts accepted: the length of the longest tree path spelling `want`."""
    node, n = 0, 0
    while n < len(want):
        nxt = next(
            (j for j in range(node + 1, len(toks)) if pars[j] == node and toks[j] == want[n]), 0
        )
        if not nxt:
            break
        node, n = nxt, n + 1
    return n


def rounds(
    seq, plen: int, lp: np.ndarray, ids: np.ndarray, budget: int, k: int, lam: float = 1.0
) -> tuple[int, int]:
    """(tokens, rounds) of greedy decoding of one answer (`seq`[plen:]) with trees of
    `budget` / top-`k` over `root_tops`' arrays."""
    seq = np.asarray(seq)
    L = lp.shape[1]
    tokens = n_rounds = 0
    root = plen - 1
    while root < len(seq) - 1:
        a = root - (plen - 1)
        toks, pars = build(lp[a, :, :k], ids[a, :, :k], budget, k, lam)
        left = len(seq) - 1 - root  # answer tokens after the root
        got = min(accepted(toks, pars, seq[root + 1 : root + 1 + L]) + 1, left)
        tokens, n_rounds, root = tokens + got, n_rounds + 1, root + got
    return tokens, n_rounds


def tau(tops: list[tuple], budget: int, k: int, lam: float = 1.0) -> float:
    """tau over sequences given as (seq, plen, lp, ids)."""
    tok = rnd = 0
    for seq, plen, lp, ids in tops:
        t, r = rounds(seq, plen, lp, ids, budget, k, lam)
        tok, rnd = tok + t, rnd + r
    return round(tok / max(rnd, 1), 4)


def chain_offsets(tops: list[tuple]) -> list[float]:
    """Per depth d: log(P(the top-1 at d is the answer's token | every shallower top-1 was)
    / the mean top-1 probability there). Near 0 at every depth: summing the drafter's
    log-probs along a path already weighs it by its chance of acceptance (calibrated)."""
    L = tops[0][2].shape[1]
    hits, tries, probs = np.zeros(L), np.zeros(L), np.zeros(L)
    for seq, plen, lp, ids in tops:
        for a in range(lp.shape[0]):
            root = plen - 1 + a
            for d in range(L):
                if root + 1 + d >= len(seq):
                    break
                tries[d] += 1
                probs[d] += math.exp(lp[a, d, 0])
                if ids[a, d, 0] != seq[root + 1 + d]:
                    break
                hits[d] += 1
    rate = hits / np.maximum(tries, 1)
    mean_p = probs / np.maximum(tries, 1)
    return [
        round(math.log(max(r, 1e-6) / max(p, 1e-6)), 4) for r, p in zip(rate, mean_p, strict=True)
    ]
