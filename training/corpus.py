"""The drafter's training corpus: the target answers prompts (self-distillation), batched
through transformers with the target's own weights (`ddserve.engine.weights.to_hf`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ddserve.bench.prompts import chat_ids
from ddserve.engine.weights import to_hf
from ddserve.training.prompts import training_prompts


def log(**kv) -> None:
    print(json.dumps(kv), flush=True)


def pad_and_stops(lm) -> tuple[int, list[int]]:
    """The padding id and the stop ids generation uses for a loaded model."""
    eos = list(lm.model.cfg.eos_token_ids)
    pad = lm.tokenizer.pad_token_id
    return (pad if pad is not None else eos[0]), eos


@torch.inference_mode()
def generate(
    hf,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    batch: int,
    pad: int,
    eos: list[int],
    seed: int,
    deadline: float,
) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) per prompt, batched with left padding."""
    out = []
    dev = hf.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths together
    torch.manual_seed(seed)
    for b in range(0, len(order), batch):
        if time.time() > deadline:
            log(stage="corpus", note="time budget reached", sequences=len(out))
            break
        idx = order[b : b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p)
            att[r, width - len(p) :] = 1
        kw = (
            dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            if temperature > 0
            else dict(do_sample=False)
        )
        gen = hf.generate(
            input_ids=ids.to(dev),
            attention_mask=att.to(dev),
            max_new_tokens=max_new,
            pad_token_id=pad,
            eos_token_id=eos,
            **kw,
        ).cpu()
        for r, i in enumerate(idx):
            answer = gen[r, width:].tolist()
            for j, t in enumerate(answer):  # cut after the first stop token
                if t in eos:
                    answer = answer[: j + 1]
                    break
            out.append((list(prompts[i]) + answer, len(prompts[i])))
    return out


def stage_corpus(args, lm, work: Path) -> list[tuple[list[int], int]]:
    path = work / "corpus.pt"
    if path.exists():
        return torch.load(path)
    hf = to_hf(lm.model)
    prompts = chat_ids(lm.tokenizer, training_prompts(args.prompts, seed=args.seed))
    pad, eos = pad_and_stops(lm)
    t0 = time.time()
    deadline = t0 + args.corpus_minutes * 60
    corpus = []
    for i, temp in enumerate(args.temperatures):
        part = generate(
            hf, prompts, args.gen_tokens, temp, args.gen_batch, pad, eos, args.seed + i, deadline
        )
        corpus += part
        new = sum(len(s) - p for s, p in part)
        log(
            stage="corpus",
            temperature=temp,
            sequences=len(part),
            answer_tokens=new,
            seconds=round(time.time() - t0, 1),
        )
    torch.save(corpus, path)
    return corpus
