"""The drafter's training blocks (ddserve.training.dflash): batches of roots drawn from
sequences, the block forward teacher-forced on the target's tapped layers, its depth-weighted
loss, and the precision both training and evaluation run in. The evaluation
(ddserve.training.dflash_eval) and the simulated rounds (training/tree_sim.py,
bench/tree_tau.py) read the same forward the training optimises."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from ddserve.engine.dflash import DFlashModel


def make_batch(seqs, nb: int, L: int, max_len: int, rng: random.Random, pad: int):
    """Token ids [B, T], anchors [B, nb] (root positions) and their validity [B, nb], from
    (ids, prompt length) pairs (ids: a list or an integer array)."""
    B = len(seqs)
    T = min(max_len, max(len(s) for s, _ in seqs))
    ids = torch.full((B, T), pad, dtype=torch.long)
    anchors = torch.zeros((B, nb), dtype=torch.long)
    valid = torch.zeros((B, nb), dtype=torch.bool)
    for b, (s, plen) in enumerate(seqs):
        s = s[:T]
        ids[b, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        lo, hi = max(0, plen - 1), len(s) - L - 1  # root in the answer (or the prompt's last)
        if hi < lo:
            continue
        cand = list(range(lo, hi + 1))
        pick = rng.sample(cand, min(nb, len(cand)))
        anchors[b, : len(pick)] = torch.tensor(sorted(pick))
        valid[b, : len(pick)] = True
    return ids, anchors, valid


def block_forward(draft: DFlashModel, target, ids, anchors, valid, taps, depth: int = 0):
    """Hidden states [B, nb, L, H] of every block's MASK positions and labels [B, nb, L];
    `depth`: blocks of that many MASK positions (the engine drafts min(depth, budget,
    block) of them), else the drafter's block size."""
    c = draft.c
    L = depth or c.block_size
    B, T = ids.shape
    nb = anchors.shape[1]
    dev = ids.device
    feats = draft.project(taps)  # [B, T, H]
    ctx_kv = draft.context_kv(feats, torch.arange(T, device=dev).expand(B, T))
    offs = torch.arange(L + 1, device=dev)
    pos = (anchors[..., None] + offs).reshape(B, nb * (L + 1))  # [B, Q]
    root = target.embed_tokens(ids.gather(1, anchors))  # [B, nb, H]
    mask_e = draft.mask_embedding.to(root.dtype).expand(B, nb, L, -1)
    block = torch.cat([root[:, :, None], mask_e], dim=2).reshape(B, nb * (L + 1), -1)
    # attention: a block's entries see context positions < its root and its own block
    qb = torch.arange(nb, device=dev).repeat_interleave(L + 1)  # block of each query
    ctx_ok = (
        torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(L + 1, 1)[..., None]
    )
    blk_ok = (qb[:, None] == qb[None, :]).expand(B, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], dim=2)[:, None]  # [B, 1, Q, T+Q]
    hidden = draft.blocks(block, pos, ctx_kv, mask)  # [B, Q, H]
    hidden = hidden.view(B, nb, L + 1, -1)[:, :, 1:]  # MASK positions
    lab_pos = (anchors[..., None] + 1 + torch.arange(L, device=dev)).clamp(max=T - 1)
    labels = ids.gather(1, lab_pos.view(B, -1)).view(B, nb, L)
    return hidden, labels


def draft_loss(draft, target, ids, anchors, valid, taps, weights):
    hidden, labels = block_forward(draft, target, ids, anchors, valid, taps)
    logits = F.linear(hidden, target.lm_head.weight)  # [B, nb, L, V]
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
    ce = ce.view(labels.shape)
    w = weights.to(ce.device)[None, None, :] * valid[..., None]
    loss = (ce * w).sum() / w.sum().clamp(min=1)
    hit = (logits.argmax(-1) == labels) & valid[..., None]
    return loss, hit.sum(dim=(0, 1)).float(), valid.sum().float()


def autocast(dev: torch.device):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def target_taps(hf, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layers], dim=-1)  # output of layer i
