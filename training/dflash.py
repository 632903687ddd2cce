"""Train a DFlash-style block drafter for a target by self-distillation.

    python -m ddserve.training.dflash --model smollm2-135m --work /tmp/dflash --out service/engine/dflash_weights/smollm2-135m

Stages (each writes into --work and is skipped when its output exists):
  corpus  the target answers training/prompts.py's prompts (greedy and T=1 samples, batched
          through transformers with the target's weights) -> corpus.pt (token ids)
  train   the drafter learns to predict the target's next L tokens from the target's hidden
          states: many blocks per sequence in one forward (each block sees the context before
          its root and itself, bidirectionally); cross-entropy weighted by depth; AdamW with
          a time-based cosine schedule, checkpoints as it goes -> drafter/ (safetensors+config)
  eval    per-depth agreement with the target's greedy continuation of held-out prompts
          -> eval.json; tau with DDTree is ddserve.bench.dflash_eval's job (the engine, not training)

Runs on CPU (tiny smoke runs) and CUDA (bf16 autocast); prints one JSON line per log step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddserve.bench.prompts import chat_ids
from ddserve.engine.dflash import DFlashConfig, DFlashModel, block_weights, load_dflash, save_dflash
from ddserve.engine.weights import load_model, to_hf
from ddserve.training.corpus import generate, log, pad_and_stops, stage_corpus
from ddserve.training.prompts import heldout_prompts


def make_batch(seqs, nb: int, L: int, max_len: int, rng: random.Random, pad: int):
    """Token ids [B, T], anchors [B, nb] (root positions) and their validity [B, nb]."""
    B = len(seqs)
    T = min(max_len, max(len(s) for s, _ in seqs))
    ids = torch.full((B, T), pad, dtype=torch.long)
    anchors = torch.zeros((B, nb), dtype=torch.long)
    valid = torch.zeros((B, nb), dtype=torch.bool)
    for b, (s, plen) in enumerate(seqs):
        s = s[:T]
        ids[b, : len(s)] = torch.tensor(s)
        lo, hi = max(0, plen - 1), len(s) - L - 1  # root in the answer (or the prompt's last)
        if hi < lo:
            continue
        cand = list(range(lo, hi + 1))
        pick = rng.sample(cand, min(nb, len(cand)))
        anchors[b, : len(pick)] = torch.tensor(sorted(pick))
        valid[b, : len(pick)] = True
    return ids, anchors, valid


def block_forward(draft: DFlashModel, target, ids, anchors, valid, taps):
    """Logits [B, nb, L, V] of every block's MASK positions and labels [B, nb, L]."""
    c = draft.c
    L = c.block_size
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


def _autocast(dev: torch.device):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def target_taps(hf, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layers], dim=-1)  # output of layer i


def stage_train(args, lm, corpus, work: Path) -> DFlashModel:
    out_dir = work / "drafter"
    if (out_dir / "model.safetensors").exists() and not args.retrain:
        return load_dflash(out_dir)
    dev = lm.model.device
    target = lm.model
    hf = to_hf(target)
    c = DFlashConfig.for_target(
        target.cfg, num_layers=args.layers, block_size=args.block, taps=args.taps, target=args.model
    )
    if args.init:
        draft = load_dflash(args.init)  # continue from an earlier run
        if draft.c != c:
            raise SystemExit(f"--init {args.init}: its config differs from this run's: {draft.c}")
    else:
        draft = DFlashModel(c)
        draft.init_from_target(target)
    draft = draft.to(dev).float().train()
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = block_weights(c.block_size, args.gamma)
    rng = random.Random(args.seed)
    pad = 0
    train = [s for s in corpus if len(s[0]) - s[1] > c.block_size + 1]
    t0 = time.time()
    budget = args.train_minutes * 60
    step, hits, blocks, loss_ema = 0, torch.zeros(c.block_size), 0.0, None
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        ids, anchors, valid = make_batch(
            rng.sample(train, min(args.batch, len(train))),
            args.blocks_per_seq,
            c.block_size,
            args.max_len,
            rng,
            pad,
        )
        ids, anchors, valid = ids.to(dev), anchors.to(dev), valid.to(dev)
        taps = target_taps(hf, ids, c.target_layers)
        with _autocast(dev):
            loss, hit, nblk = draft_loss(draft, target, ids, anchors, valid, taps, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        hits += hit.cpu()
        blocks += float(nblk)
        loss_ema = float(loss) if loss_ema is None else 0.98 * loss_ema + 0.02 * float(loss)
        if step % args.log_every == 0:
            acc = (hits / max(blocks, 1)).tolist()
            log(
                stage="train",
                step=step,
                seconds=round(time.time() - t0, 1),
                lr=round(lr, 6),
                loss=round(loss_ema, 4),
                acc_by_depth=[round(a, 3) for a in acc],
            )
            hits, blocks = torch.zeros(c.block_size), 0.0
        if step % args.ckpt_every == 0:
            save_dflash(draft, out_dir, {"steps": step, "partial": True})
    meta = {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "sequences": len(train),
        "answer_tokens": sum(len(s) - p for s, p in train),
        "batch": args.batch,
        "blocks_per_seq": args.blocks_per_seq,
        "lr": args.lr,
        "gamma": args.gamma,
        "final_loss_ema": loss_ema,
        "command": " ".join(["python -m ddserve.training.dflash", *sys.argv[1:]]),
        "init": args.init,
    }
    save_dflash(draft, out_dir, meta)
    log(stage="train", done=True, **meta)
    return load_dflash(out_dir)


@torch.inference_mode()
def stage_eval(args, lm, draft: DFlashModel, work: Path, corpus=None) -> dict:
    """Per-depth agreement: the drafter's top-1 at depth d vs the target's greedy token there,
    on greedy continuations of held-out prompts (teacher-forced context)."""
    path = work / "heldout.pt"
    hf = to_hf(lm.model)
    if path.exists():
        held = torch.load(path)
    else:
        pad, eos = pad_and_stops(lm)
        held = generate(
            hf,
            chat_ids(lm.tokenizer, heldout_prompts()),
            args.gen_tokens,
            0.0,
            args.gen_batch,
            pad,
            eos,
            0,
            time.time() + 3600,
        )
        torch.save(held, path)
    dev = lm.model.device
    draft = draft.to(dev).eval()
    c = draft.c

    def agreement(seqs):
        hits, blocks = torch.zeros(c.block_size), 0.0
        rng = random.Random(1)
        for i in range(0, len(seqs), 8):
            ids, anchors, valid = make_batch(
                seqs[i : i + 8], 64, c.block_size, args.max_len, rng, 0
            )
            ids, anchors, valid = ids.to(dev), anchors.to(dev), valid.to(dev)
            taps = target_taps(hf, ids, c.target_layers)
            with _autocast(dev):
                _, hit, nblk = draft_loss(
                    draft,
                    lm.model,
                    ids,
                    anchors,
                    valid,
                    taps,
                    block_weights(c.block_size, args.gamma),
                )
            hits += hit.cpu()
            blocks += float(nblk)
        return (hits / max(blocks, 1)).tolist(), int(blocks)

    acc, blocks = agreement(held)
    # expected accepted drafts of a single chain if depth errors were independent
    chain = sum(math.prod(acc[: d + 1]) for d in range(len(acc)))
    res = {
        "heldout_sequences": len(held),
        "blocks": blocks,
        "agreement_by_depth": [round(a, 4) for a in acc],
        "next_token_agreement": round(acc[0], 4),
        "cumulative_agreement_chain": round(chain, 3),
    }
    if corpus:  # the same measure on greedy training sequences: the over-fitting gap
        seen = corpus[: len(corpus) // max(1, len(args.temperatures))][::50][:48]
        tacc, _ = agreement(seen)
        res["train_distribution_agreement_by_depth"] = [round(a, 4) for a in tacc]
    (work / "eval.json").write_text(json.dumps(res, indent=1))
    log(stage="eval", **res)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--work", default="/tmp/dflash-work")
    ap.add_argument("--out", help="copy the trained drafter (model.safetensors + config.json) here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stages", default="corpus,train,eval")
    ap.add_argument("--prompts", type=int, default=100000)
    ap.add_argument(
        "--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0]
    )
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--corpus-minutes", type=float, default=3.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--taps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--blocks-per-seq", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--train-minutes", type=float, default=5.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--init", help="start from this trained drafter directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    lm = load_model(args.model, args.device, dtype)
    stages = args.stages.split(",")
    corpus = stage_corpus(args, lm, work) if "corpus" in stages or "train" in stages else None
    draft = (
        stage_train(args, lm, corpus, work) if "train" in stages else load_dflash(work / "drafter")
    )
    if "eval" in stages:
        stage_eval(args, lm, draft, work, corpus)
    if args.out:
        import shutil

        Path(args.out).mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            shutil.copy(work / "drafter" / name, Path(args.out) / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
