"""The drafter's eval stage (ddserve.training.dflash): per-depth agreement with the
target's greedy continuations of held-out prompts per eval set, the chain estimate, the tau of
simulated DDTree rounds (training/tree_sim.py) and the gap to training-style sequences ->
eval.json."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import torch

from ddserve.engine.dflash import DFlashModel, block_weights, load_draft_vocab
from ddserve.engine.weights import to_hf
from ddserve.training import tree_sim
from ddserve.training.corpus import CorpusEngine, heldout_set
from ddserve.training.corpus import log_json as log
from ddserve.training.corpus_store import Corpus
from ddserve.training.dflash_blocks import (
    autocast,
    block_forward,
    draft_loss,
    make_batch,
    target_taps,
)
from ddserve.training.prompts import DOMAINS, EVAL_SETS, SOURCES

EVAL_LEN = 2048  # eval reads whole held-out sequences (long HumanEval prompts too)


@torch.inference_mode()
def agreement(args, lm, hf, draft: DFlashModel, seqs) -> tuple[list[float], int]:
    """Per-depth agreement of the drafter's top-1 with the sequences' next tokens (teacher-
    forced context; up to --eval-blocks blocks per sequence, fixed rng) and the blocks
    counted."""
    dev, c = lm.model.device, draft.c
    hits, blocks = torch.zeros(c.block_size), 0.0
    rng = random.Random(1)
    weights = block_weights(c.block_size, args.gamma)
    for i in range(0, len(seqs), 8):
        batch = seqs[i : i + 8]
        ids, anchors, valid = make_batch(batch, args.eval_blocks, c.block_size, EVAL_LEN, rng, 0)
        ids, anchors, valid = ids.to(dev), anchors.to(dev), valid.to(dev)
        taps = target_taps(hf, ids, c.target_layers)
        with autocast(dev):
            _, hit, nblk = draft_loss(draft, lm.model, ids, anchors, valid, taps, weights)
        hits += hit.cpu()
        blocks += float(nblk)
    return (hits / max(blocks, 1)).tolist(), int(blocks)


@torch.inference_mode()
def answer_hidden(hf, target, draft: DFlashModel, ids: torch.Tensor, plen: int, depth: int = 0):
    """The drafter's block outputs [A, L, H] at every root of one sequence's answer (ids
    [1, T]: a prompt of `plen` tokens + answer; roots plen - 1 .. T - 2), teacher-forced on
    the target's tapped layers: what the engine's drafter sees there (training/tree_sim.py)."""
    anchors = torch.arange(plen - 1, ids.shape[1] - 1, device=ids.device)[None]
    taps = target_taps(hf, ids, draft.c.target_layers)
    hidden, _ = block_forward(draft, target, ids, anchors, anchors >= 0, taps, depth)
    return hidden[0]


def answer_tops(lm, hf, draft: DFlashModel, seqs, k: int, vocab=None) -> list[tuple]:
    """(seq, plen, top-k log-probs, ids) per sequence at every root of its answer, for the
    simulated rounds of training/tree_sim.py (over the LM head's `vocab` rows, or all)."""
    dev = lm.model.device
    head = lm.model.lm_head.weight
    if vocab is not None:
        vocab = vocab.to(dev)
        head = head[vocab]
    out = []
    for s, plen in seqs:
        s = np.asarray(s)[:EVAL_LEN]
        if len(s) < plen + 1:
            continue
        with autocast(dev):
            hidden = answer_hidden(hf, lm.model, draft, torch.as_tensor(s, device=dev)[None], plen)
        lp, top = tree_sim.root_tops(hidden, head, k, vocab)
        out.append((s, plen, lp, top))
    return out


def chain(acc: list[float]) -> float:
    """Expected accepted drafts of a single chain if depth errors were independent."""
    return sum(math.prod(acc[: d + 1]) for d in range(len(acc)))


def report(acc: list[float], sequences: int, blocks: int) -> dict:
    return {
        "sequences": sequences,
        "blocks": blocks,
        "agreement_by_depth": [round(a, 4) for a in acc],
        "next_token_agreement": round(acc[0], 4),
        "cumulative_agreement_chain": round(chain(acc), 3),
    }


@torch.inference_mode()
def stage_eval(args, lm, draft: DFlashModel, work: Path, corpus: Corpus | None = None) -> dict:
    """Agreement on the held-out greedy continuations per eval set (prompts.EVAL_SETS: chat,
    code, legacy) and, with the corpus, on up to 48 greedy training sequences per domain
    (the train-distribution gap) -> eval.json."""
    path = work / "heldout.npz"
    if path.exists():
        held = Corpus.load(path)
    else:
        with CorpusEngine(args, lm) as eng:
            held = heldout_set(eng, work)
    hf = to_hf(lm.model)
    draft = draft.to(lm.model.device).eval()
    res: dict = {"heldout": {}}
    # the simulated rounds draft from the drafter's vocabulary, as the engine would
    vocab = load_draft_vocab(work / "drafter")
    res["tree_tau_vocab"] = None if vocab is None else len(vocab)
    for name, sources in EVAL_SETS.items():
        idx = held.indices(sources)
        acc, blocks = agreement(args, lm, hf, draft, [held.sequence(i) for i in idx])
        res["heldout"][name] = report(acc, len(idx), blocks)
        tops = (
            []
            if name == "legacy"
            else answer_tops(lm, hf, draft, [held.sequence(i) for i in idx], 4, vocab)
        )
        if tops:  # greedy rounds of the engine's trees over these answers (tree_sim)
            res["heldout"][name]["tree_tau"] = {
                f"b{b}k{k}": tree_sim.tau(tops, b, k) for b, k in tree_sim.EVAL_TREES
            }
            res["heldout"][name]["chain_offsets"] = tree_sim.chain_offsets(tops)
    legacy = res["heldout"]["legacy"]  # the keys of earlier eval.json files
    res.update({k: legacy[k] for k in ("agreement_by_depth", "next_token_agreement")})
    res["cumulative_agreement_chain"] = legacy["cumulative_agreement_chain"]
    if corpus is not None and len(corpus):
        res["train_distribution"], res["gap_next_token"] = {}, {}
        for dom in DOMAINS:
            sources = [s for s in corpus.sources if SOURCES[s] == dom]
            idx = corpus.indices(sources, temperature=0.0) or corpus.indices(sources)
            idx = random.Random(0).sample(idx, min(48, len(idx)))
            acc, blocks = agreement(args, lm, hf, draft, [corpus.sequence(i) for i in idx])
            res["train_distribution"][dom] = report(acc, len(idx), blocks)
            gap = acc[0] - res["heldout"][dom]["next_token_agreement"]
            res["gap_next_token"][dom] = round(gap, 4)
    (work / "eval.json").write_text(json.dumps(res, indent=1))
    log(stage="eval", **res)
    return res
