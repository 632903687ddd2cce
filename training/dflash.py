"""Train a DFlash-style block drafter for a target by self-distillation.

    python -m ddserve.training.dflash --model smollm2-135m --work /tmp/dflash --out service/engine/dflash_weights/smollm2-135m

Stages (each writes into --work and is skipped when its output exists):
  corpus  the target writes prompts and answers them (greedy and T=1 samples) through
          ddserve's own engine, many requests in flight, within --corpus-minutes; held-out
          sets first (training/corpus.py) -> heldout.npz, corpus-NNN.npz (training/corpus_store.py);
          --train-seed draws other training prompts under the same held-out set, and
          --corpus-from adds earlier runs' corpora (less this run's held-out prompts:
          training/corpus_merge.py)
  train   the drafter learns to predict the target's next L tokens from the target's hidden
          states: many blocks per sequence in one forward (each block sees the context before
          its root and itself, bidirectionally: training/dflash_blocks.py); cross-entropy
          weighted by depth; AdamW with a time-based cosine schedule, checkpoints as it goes
          -> drafter/ (safetensors+config); --init DIR continues from a trained drafter
  eval    per-depth agreement with the target's greedy continuation of held-out prompts, per
          domain (chat, code, and `legacy`: the committed drafter's held-out set), the chain
          estimate, and the same on greedy training sequences (the over-fitting gap)
          and the tau of greedy DDTree rounds simulated on the held-out answers (b8/k2,
          b16/k4, b32/k4: training/tree_sim.py) -> eval.json (training/dflash_eval.py); the
          engine measures its own (ddserve.bench.engine_cpu)

Runs on CPU (tiny smoke runs) and CUDA (bf16 autocast); logs one JSON line per event.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from ddserve.engine.dflash import (
    DFlashConfig,
    DFlashModel,
    block_weights,
    load_dflash,
    save_dflash,
)
from ddserve.engine.weights import load_model, load_tokenizer, to_hf
from ddserve.training import draft_vocab
from ddserve.training.corpus import log_json as log
from ddserve.training.corpus import stage_corpus
from ddserve.training.corpus_merge import with_earlier
from ddserve.training.corpus_store import Corpus, load_parts, part_paths
from ddserve.training.dflash_blocks import autocast, draft_loss, make_batch, target_taps
from ddserve.training.dflash_eval import stage_eval


def stage_train(args, lm, corpus: Corpus, work: Path) -> DFlashModel:
    """Train (or continue, --init) the drafter on the corpus' sequences whose answer is longer
    than a block; samples sequences uniformly."""
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
    # a block needs its root and L labels inside the first --max-len tokens
    train = [
        i
        for i in range(len(corpus))
        if corpus.answer_len(i) > c.block_size + 1
        and corpus.prompt_len(i) + c.block_size + 1 < args.max_len
    ]
    if not train:
        raise SystemExit(f"no corpus sequence holds a block within --max-len {args.max_len}")
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
            [corpus.sequence(i) for i in rng.sample(train, min(args.batch, len(train)))],
            args.blocks_per_seq,
            c.block_size,
            args.max_len,
            rng,
            pad,
        )
        ids, anchors, valid = ids.to(dev), anchors.to(dev), valid.to(dev)
        taps = target_taps(hf, ids, c.target_layers)
        with autocast(dev):
            loss, hit, nblk = draft_loss(draft, target, ids, anchors, valid, taps, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        hits += hit.cpu()
        blocks += float(nblk)
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.98 * loss_ema + 0.02 * lv
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
        "answer_tokens": sum(corpus.answer_len(i) for i in train),
        "corpus_by_source": corpus.summary()["by_source"],
        "batch": args.batch,
        "blocks_per_seq": args.blocks_per_seq,
        "lr": args.lr,
        "gamma": args.gamma,
        "final_loss_ema": loss_ema,
        "command": " ".join(["python -m ddserve.training.dflash", *sys.argv[1:]]),
        "init": args.init,
    }
    if args.draft_vocab > 0:  # the LM head rows it drafts from: its corpus' answer tokens
        tok = lm.tokenizer or load_tokenizer(args.model)
        counts = draft_vocab.answer_counts(corpus, lm.model.cfg.vocab_size)
        ids, coverage = draft_vocab.keep_ids(counts, args.draft_vocab, tok, lm.model.cfg.vocab_size)
        draft_vocab.save_vocab(ids, out_dir)
        meta["draft_vocab"] = {"tokens": len(ids), "answer_coverage": round(coverage, 4)}
    else:  # the whole head: no vocabulary of an earlier run beside the new weights
        (out_dir / "draft_vocab.safetensors").unlink(missing_ok=True)
    save_dflash(draft, out_dir, meta)
    log(stage="train", done=True, **meta)
    return load_dflash(out_dir)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = ap.add_argument
    arg("--model", default="smollm2-135m")
    arg("--work", default="/tmp/dflash-work")
    arg("--out", help="copy the trained drafter (model.safetensors + config.json) here")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg("--stages", default="corpus,train,eval")
    arg("--seed", type=int, default=0, help="the held-out set's seed (and the training's)")
    arg("--train-seed", type=int, help="another seed for the training prompts and answers")
    arg("--corpus-from", help="also train on the corpus parts of these earlier work dirs (a,b)")
    # corpus: what is generated
    arg("--prompts", type=int, default=100000, help="training prompts planned (the mix), at most")
    arg("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    arg("--gen-tokens", type=int, default=256, help="answer tokens per request, at most")
    arg("--corpus-minutes", type=float, default=4.0, help="the corpus stage's time budget")
    arg("--self-prompts", type=int, default=20000, help="training prompt-writing requests")
    arg("--heldout-self", type=int, default=64, help="held-out self-written prompts (chat)")
    arg("--write-share", type=float, default=0.2, help="budget share for writing prompts")
    arg("--write-tokens", type=int, default=160, help="longest self-written prompt, tokens")
    arg("--write-temperature", type=float, default=1.0)
    arg("--code-share", type=float, default=0.25, help="self-written prompts of code kinds")
    arg("--continuations", type=int, default=4000, help="prompts per continuation source")
    arg("--mix", help="source weights over prompts.MIX, e.g. self_chat=0.4,templated=0.02")
    arg("--max-prompt", type=int, default=1024, help="longer prompts are left out (tokens)")
    arg("--corpus-part-mib", type=float, default=15.0, help="largest corpus-NNN.npz, MiB")
    # corpus: the engine that generates it
    cuda = torch.cuda.is_available()
    arg("--engine-batch", type=int, default=256 if cuda else 8, help="KV slots (max_batch)")
    arg("--concurrency", type=int, help="requests in flight (default: --engine-batch)")
    arg("--engine-context", type=int, default=2048, help="max_context of a request")
    arg("--engine-graphs", default="auto", choices=["auto", "on", "off"])
    arg("--engine-compile", default="off", choices=["auto", "on", "off"])
    # train
    arg("--layers", type=int, default=2)
    arg("--block", type=int, default=8)
    arg("--taps", type=int, default=4)
    arg("--batch", type=int, default=64)
    arg("--blocks-per-seq", type=int, default=32)
    arg("--max-len", type=int, default=512)
    arg("--lr", type=float, default=6e-4)
    arg("--warmup", type=int, default=50)
    arg("--gamma", type=float, default=4.0)
    arg("--train-minutes", type=float, default=5.0)
    arg("--max-steps", type=int, default=0)
    arg("--eval-blocks", type=int, default=64, help="blocks per held-out sequence in eval")
    arg("--log-every", type=int, default=25)
    arg("--ckpt-every", type=int, default=200)
    arg("--retrain", action="store_true")
    arg("--init", help="start from this trained drafter directory")
    arg("--draft-vocab", type=int, default=16384,
        help="the drafter's vocabulary: the corpus answers' most frequent tokens (0: all)")  # fmt: skip
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.draft_vocab < 0:
        raise SystemExit("dflash: --draft-vocab must be 0 (the whole LM head) or more")
    args.concurrency = args.concurrency or args.engine_batch
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    lm = load_model(args.model, args.device, dtype)
    stages = args.stages.split(",")
    corpus = None
    if "corpus" in stages or "train" in stages:
        corpus = stage_corpus(args, lm, work)
        if args.corpus_from:
            corpus = with_earlier(corpus, args.corpus_from.split(","), work, lm.tokenizer)
    elif part_paths(work):
        corpus = load_parts(work)  # for eval's train-distribution gap
    if "train" in stages:
        draft = stage_train(args, lm, corpus, work)
    elif "eval" in stages:
        draft = load_dflash(work / "drafter")
    if "eval" in stages:
        stage_eval(args, lm, draft, work, corpus)
    if args.out:
        import shutil

        Path(args.out).mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            shutil.copy(work / "drafter" / name, Path(args.out) / name)
        vocab = Path(args.out) / "draft_vocab.safetensors"  # the drafter's, or none
        if (work / "drafter" / vocab.name).exists():
            shutil.copy(work / "drafter" / vocab.name, vocab)
        else:
            vocab.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
