"""Train a DFlash-style block drafter for a target by self-distillation.

    python -m ddserve.training.dflash --model smollm2-135m --work /tmp/dflash --out service/engine/dflash_weights/smollm2-135m

Stages (each writes into --work and is skipped when its output exists):
  corpus  the target writes prompts and answers them (greedy and T=1 samples) through
          ddserve's own engine, many requests in flight, within --corpus-minutes; held-out
          sets first (training/corpus.py) -> heldout.npz, corpus-NNN.npz (training/corpus_store.py);
          --train-seed draws other training prompts under the same held-out set, and
          --corpus-from adds earlier runs' corpora (less this run's held-out prompts)
  train   the drafter learns to predict the target's next L tokens from the target's hidden
          states: many blocks per sequence in one forward (each block sees the context before
          its root and itself, bidirectionally); cross-entropy weighted by depth; AdamW with
          a time-based cosine schedule, checkpoints as it goes -> drafter/ (safetensors+config);
          --init DIR continues from a trained drafter
  eval    per-depth agreement with the target's greedy continuation of held-out prompts, per
          domain (chat, code, and `legacy`: the committed drafter's held-out set), the chain
          estimate, and the same on greedy training sequences (the over-fitting gap)
          and the tau of greedy DDTree rounds simulated on the held-out answers (b8/k2,
          b16/k4, b32/k4: training/tree_sim.py) -> eval.json; the engine measures its own
          (ddserve.bench.engine_cpu)

Runs on CPU (tiny smoke runs) and CUDA (bf16 autocast); logs one JSON line per event.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddserve.engine.dflash import (
    DFlashConfig,
    DFlashModel,
    block_weights,
    load_dflash,
    load_draft_vocab,
    save_dflash,
)
from ddserve.engine.weights import load_model, load_tokenizer, to_hf
from ddserve.training import draft_vocab, tree_sim
from ddserve.training.corpus import (
    CorpusEngine,
    heldout_set,
    stage_corpus,
    summary,
    with_earlier,
)
from ddserve.training.corpus import log_json as log
from ddserve.training.corpus_store import Corpus, load_parts, part_paths
from ddserve.training.prompts import DOMAINS, EVAL_SETS, SOURCES


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


def _autocast(dev: torch.device):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def target_taps(hf, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layers], dim=-1)  # output of layer i


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
        with _autocast(dev):
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
        "corpus_by_source": summary(corpus)["by_source"],
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
        with _autocast(dev):
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
        with _autocast(dev):
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
