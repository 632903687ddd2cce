"""Offline tree acceptance (issue 14): the tau greedy DDTree rounds of a given budget / top-k
and node scoring would reach on the target's own answers, without the engine
(training/tree_sim.py simulates the rounds).

Each held-out prompt's greedy answer (`--max-tokens`, stopping at EOS) is made once by the
target (transformers' generate over the same weights); one target forward over prompt +
answer and one drafter forward give every root position's per-depth top-k, through the
engine's drafter; each draft vocabulary of `--vocabs` is then the drafter's head restricted
to its rows (the engine's DFlashDrafter with that vocabulary).

Every round drafts min(`--depth`, block size) positions, as the engine does whatever the
budget (StaticEngine.block_depth); `--cut-blocks` drafts min(depth, budget, block) instead,
as the engine did before 2026-12-06 (the block's attention is bidirectional: a short block's
distributions are not a longer block's first ones).

Node scorings (`--scorings`), ways to weigh a tree node:
  product          the engine's: the sum of the path's log-probs (DDTree's)
  bias:B1/B2/..    per-depth offsets added to the log-probs (depth 1 first; the last repeats)
  lambda:L         a node's weight = its log-prob + L x its parent's weight (1: product)
  temp:T           log-probs of the drafter's logits / T
  fit              per-depth offsets measured here (tree_sim.chain_offsets: each depth's
                   top-1 acceptance given its parent's, over its mean top-1 probability)

  python -m ddserve.bench.tree_tau [--prompt-set heldout] [--max-tokens 128]
      [--budgets 8,16,32] [--topk 2,4,8] [--scorings product,fit,lambda:0.75]
      [--dflash DIR] [--vocabs drafter,full,DIR] [--depth 8] [--cut-blocks] [--device cpu] [--name tree_tau] [--out bench/results/tree-tau]

Writes OUT/NAME.json: per vocabulary, scoring, budget and top-k, tau over every prompt and per domain
(the held-out set's 8 chat prompts, then HumanEval's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddserve.training import tree_sim

N_CHAT = 8  # heldout_prompts(): 8 chat prompts, then HumanEval's held-out problems


def parse_scoring(spec: str):
    """(name, kind, value) of a --scorings entry."""
    kind, _, val = spec.partition(":")
    try:
        if kind in ("product", "fit") and not val:
            return spec, kind, None
        if kind == "bias":
            return spec, kind, [float(x) for x in val.split("/")]
        if kind in ("lambda", "temp"):
            return spec, kind, float(val)
    except ValueError:
        pass
    raise SystemExit(
        f"tree_tau: unknown scoring {spec!r} (product, fit, bias:B1/B2/.., lambda:L, temp:T)"
    )


@torch.inference_mode()
def answers(lm, drafter, prompts, max_tokens: int, depths: list[int]) -> list:
    """Per prompt (seq, plen, {depth: hidden [A, depth, H]}): the greedy answer and the
    drafter's block outputs at each of its roots, for blocks of each depth (the engine
    drafts min(its depth, block size) positions; --cut-blocks: min(depth, budget, block), and
    the block's attention is bidirectional: a shorter block is not a longer one's prefix)."""
    from ddserve.engine.weights import to_hf
    from ddserve.training.dflash_eval import answer_hidden

    hf = to_hf(lm.model)
    net, dev = drafter.net, lm.model.device
    eos = list(lm.model.cfg.eos_token_ids) or None
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=dev)
        seq = hf.generate(
            x, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
        )[0]  # fmt: skip
        plen = len(ids)
        hidden = {d: answer_hidden(hf, lm.model, net, seq[None], plen, d) for d in depths}
        out.append((seq.cpu().numpy(), plen, hidden))
    return out


def vocabularies(spec: str, dflash: str, vocab_size: int) -> dict:
    """--vocabs: name -> token ids (None: the whole LM head)."""
    from ddserve.engine.dflash import load_draft_vocab

    out = {}
    for name in spec.split(","):
        if name == "full":
            out[name] = None
        elif name == "drafter":
            out[name] = load_draft_vocab(dflash)
        else:
            try:
                out[name] = load_draft_vocab(Path(name))
            except Exception as exc:  # noqa: BLE001 - one readable line
                raise SystemExit(f"tree_tau: --vocabs {name}: {exc}") from None
            if out[name] is None:
                raise SystemExit(f"tree_tau: --vocabs {name}: no draft_vocab.safetensors there")
        ids = out[name]
        if ids is not None and (
            ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size
        ):
            raise SystemExit(f"tree_tau: --vocabs {name}: token ids outside [0, {vocab_size})")
    return out


def simulate(data, budget: int, k: int, kind: str, val, offsets, n_chat=N_CHAT) -> dict:
    """tau over every answer, and per domain when the first `n_chat` answers are chat ones
    (the held-out set: 8 chat prompts, then HumanEval's)."""
    temp = val if kind == "temp" else 1.0
    lam = val if kind == "lambda" else 1.0
    by = {"chat": [], "code": [], "all": []}
    for p, (seq, plen, tops) in enumerate(data):
        lp, ids = tops[temp]
        if kind in ("bias", "fit"):
            b = list(offsets if kind == "fit" else val)
            b = (b + [b[-1]] * lp.shape[1])[: lp.shape[1]]
            lp = lp + np.asarray(b)[None, :, None]
        by["all" if n_chat is None else "chat" if p < n_chat else "code"].append(
            (seq, plen, lp, ids)
        )
    out = {d: tree_sim.tau(rows, budget, k, lam) for d, rows in by.items() if rows and d != "all"}
    out["all"] = tree_sim.tau(by["chat"] + by["code"] + by["all"], budget, k, lam)
    return out


def main(argv=None) -> int:
    from ddserve.bench.engine_cpu import prompt_set
    from ddserve.bench.prompts import chat_ids
    from ddserve.engine.dflash import BUILTIN, DFlashDrafter, load_dflash
    from ddserve.engine.weights import load_model
    from ddserve.errors import ConfigError

    ap = argparse.ArgumentParser(
        prog="python -m ddserve.bench.tree_tau", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dflash", default=str(BUILTIN["smollm2-135m"]))
    ap.add_argument("--prompt-set", default="heldout")
    ap.add_argument(
        "--vocabs",
        default="drafter",
        help="draft vocabularies compared (a,b): drafter (its own), full (the whole LM head), "
        "or a directory holding a draft_vocab.safetensors",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=8, help="the engine's draft depth (its --depth)")
    ap.add_argument(
        "--cut-blocks", action="store_true", help="blocks of min(depth, budget) positions"
    )
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--topk", default="2,4,8")
    ap.add_argument("--scorings", default="product,fit,lambda:0.75")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="tree_tau")
    ap.add_argument("--out", default="bench/results/tree-tau")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    try:
        budgets = [int(x) for x in a.budgets.split(",")]
        topks = [int(x) for x in a.topk.split(",")]
    except ValueError:
        raise SystemExit("tree_tau: --budgets and --topk take comma-separated integers") from None
    if min(budgets + topks) < 1 or a.max_tokens < 1 or a.depth < 1:
        raise SystemExit("tree_tau: budgets, top-k, --depth and --max-tokens must be >= 1")
    scorings = [parse_scoring(s) for s in a.scorings.split(",") if s]
    temps = sorted({1.0} | {v for _, kind, v in scorings if kind == "temp"})
    if min(temps) <= 0:
        raise SystemExit("tree_tau: temp:T needs T > 0")
    t0 = time.time()
    try:
        lm = load_model(a.model, a.device, torch.float32)
        net = load_dflash(a.dflash)
        drafter = DFlashDrafter(net, lm.model)
    except (ConfigError, OSError, ValueError) as exc:
        raise SystemExit(f"tree_tau: {exc}") from None
    try:
        texts = prompt_set(a.prompt_set)
    except (ValueError, IndexError, KeyError):
        raise SystemExit(
            f"tree_tau: --prompt-set {a.prompt_set!r}: chat, humaneval, mixed, heldout or heldout:N"
        ) from None
    vocabs = vocabularies(a.vocabs, a.dflash, lm.model.cfg.vocab_size)
    prompts = chat_ids(lm.tokenizer, texts)
    depth_of = {  # as the engine drafts
        b: min(a.depth, net.c.block_size, b if a.cut_blocks else a.depth) for b in budgets
    }
    hidden = answers(lm, drafter, prompts, a.max_tokens, sorted(set(depth_of.values())))
    made = time.time() - t0
    n_chat = N_CHAT if a.prompt_set.startswith("heldout") else None
    rows, offsets = [], {}
    head = lm.model.lm_head.weight
    for vname, vocab in vocabs.items():
        rows_v = head if vocab is None else head[vocab]
        data = {
            d: [
                (s, p, {t: tree_sim.root_tops(h[d], rows_v, max(topks), vocab, t) for t in temps})
                for s, p, h in hidden
            ]
            for d in sorted(set(depth_of.values()))
        }
        full = data[max(data)]
        off = offsets[vname] = tree_sim.chain_offsets([(s, p, *t[1.0]) for s, p, t in full])
        for name, kind, val in scorings:
            for budget in budgets:
                for k in topks:
                    tau = simulate(data[depth_of[budget]], budget, k, kind, val, off, n_chat)
                    rows.append(
                        {"vocab": vname, "scoring": name, "budget": budget, "topk": k, "tau": tau}
                    )
                    per = ", ".join(f"{d} {v:.3f}" for d, v in tau.items() if d != "all")
                    print(
                        f"{vname[-24:]:>24} {name:>14} b{budget:<3} k{k}  tau {tau['all']:.3f}"
                        f"  ({per})",
                        flush=True,
                    )
    res = {
        "command": "python -m ddserve.bench.tree_tau " + " ".join(argv),
        "dflash": a.dflash,
        "prompts": len(prompts),
        "answer_tokens": int(sum(len(s) - p for s, p, _ in hidden)),
        "vocabs": {n: None if v is None else len(v) for n, v in vocabs.items()},
        "depth_of_budget": depth_of,
        "chain_offsets": offsets,
        "seconds_to_distributions": round(made, 1),
        "rows": rows,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (a.name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
