"""Simulated DDTree rounds (training/tree_sim.py): the engine's tree, node for node; the
rounds' arithmetic; and against the engine itself, the rounds of a real greedy request (the
bundled SmolLM2 and its drafter, fp32 on this CPU)."""

import math

import numpy as np
import pytest
import torch

from ddserve.engine.tree import build_tree_top
from ddserve.training import tree_sim


def random_tops(rng, depth, k, vocab=50, ties=False, holes=False):
    lp = np.log(rng.dirichlet(np.ones(vocab), size=depth))
    if ties:
        lp = np.round(lp, 1)  # many equal weights: the heap's tie order decides
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(lp, order, axis=1)
    if holes and k > 1:  # a depth with fewer candidates than k (-inf), as a small draft vocabulary
        top[rng.integers(depth), rng.integers(1, k) :] = -math.inf
    return top, order


@pytest.mark.parametrize("ties,holes", [(False, False), (True, False), (False, True)])
def test_build_is_the_engines_tree_node_for_node(ties, holes):
    rng = np.random.default_rng(0)
    for _ in range(200):
        depth, k, budget = (
            int(rng.integers(1, 9)),
            int(rng.integers(1, 6)),
            int(rng.integers(1, 40)),
        )
        lp, ids = random_tops(rng, depth, k, ties=ties, holes=holes)
        toks, pars = tree_sim.build(lp, ids, budget, k)
        ref = build_tree_top(-1, lp.tolist(), ids.tolist(), budget)
        assert toks[1:] == ref.tokens[1:] and pars == ref.parents


def test_lambda_below_one_lets_a_deep_path_outweigh_a_second_choice():
    # depth 1: 0.6 / 0.4; depth 2: 0.9 / 0.1. The sum ranks (1a, 2a) at log .54 over 1b at
    # log .4 either way; with lam = 0 a node weighs its own log-prob alone: 2a (.9) first
    lp = np.log(np.array([[0.6, 0.4], [0.9, 0.1]]))
    ids = np.array([[10, 11], [20, 21]])
    assert tree_sim.build(lp, ids, 2, 2) == ([-1, 10, 20], [-1, 0, 1])
    assert tree_sim.build(lp, ids, 3, 2, lam=0.0) == ([-1, 10, 20, 11], [-1, 0, 1, 0])


def test_rounds_count_accepted_drafts_and_the_bonus():
    # a chain drafter that always proposes the answer's next 3 tokens: 4 tokens a round, the
    # last round cut to what is left of the answer (17 tokens: 4 rounds of 4, then 1); one
    # that never does: 1 token a round
    seq = np.arange(100, 121)
    plen = 4
    roots = len(seq) - plen
    lp = np.zeros((roots, 3, 1))
    ids = np.zeros((roots, 3, 1), dtype=np.int64)
    for a in range(roots):
        root = plen - 1 + a
        ids[a, :, 0] = [seq[min(root + 1 + d, len(seq) - 1)] for d in range(3)]
    assert tree_sim.rounds(seq, plen, lp, ids, budget=3, k=1) == (17, 5)
    assert tree_sim.rounds(seq, plen, lp, ids * 0, budget=3, k=1) == (17, 17)


def test_an_accepted_path_may_run_through_a_second_choice():
    # depth 1's best guess is wrong, its second right; depth 2's best is right: with k=2 and
    # budget 3 the tree is (wrong, right) at depth 1 and the child of `wrong` at depth 2
    # (weights .6*.9 > .4), so one token is accepted, then the bonus; budget 4 adds the
    # child of `right`: two accepted
    seq = np.array([1, 2, 3, 4])
    lp = np.log(np.array([[[0.6, 0.4], [0.9, 0.1]]] * 3))
    ids = np.array([[[9, 3], [4, 8]]] * 3)
    toks, pars = tree_sim.build(lp[0], ids[0], 3, 2)
    assert toks == [-1, 9, 4, 3] and pars == [-1, 0, 1, 0]
    assert tree_sim.accepted(toks, pars, seq[2:]) == 1
    toks, pars = tree_sim.build(lp[0], ids[0], 4, 2)
    assert tree_sim.accepted(toks, pars, seq[2:]) == 2
    assert tree_sim.rounds(seq, 2, lp, ids, budget=4, k=2) == (2, 1)
    # fewer candidates than asked: the engine's rule, only those
    assert tree_sim.build(lp[0][:, :1], ids[0][:, :1], 4, 2)[0] == [-1, 9, 4]


@pytest.mark.slow
def test_simulated_rounds_match_the_engines_rounds():
    """The engine's greedy rounds of the bundled drafter (b16/k4, its draft vocabulary) and
    the simulation's over the same answer: the same accepted lengths round by round, but
    where the two computations' float rounding reorders a near-tie."""
    from ddserve.bench.prompts import chat_ids
    from ddserve.config.engine import LiveParams
    from ddserve.engine.dflash import BUILTIN, DFlashDrafter, load_dflash, load_draft_vocab
    from ddserve.engine.sampling import SamplingParams
    from ddserve.engine.weights import load_model, to_hf
    from ddserve.training.dflash_blocks import block_forward, target_taps
    from tests.engine.reference import one_engine

    lm = load_model("smollm2-135m")
    m = lm.model
    path = BUILTIN["smollm2-135m"]
    drafter = DFlashDrafter(load_dflash(path), m, load_draft_vocab(path))
    hf = to_hf(m)
    same = total = 0
    for prompt in chat_ids(
        lm.tokenizer,
        ["Write a Python function that reverses a list.", "Give me a short recipe for pancakes."],
    ):
        seq = one_engine(m, drafter, 8, m.cfg.eos_token_ids).generate(
            prompt, SamplingParams(max_tokens=48), LiveParams(budget=16, topk=4)
        )
        full = torch.tensor([prompt + seq.output])
        plen = len(prompt)
        anchors = torch.arange(plen - 1, full.shape[1] - 1)[None]
        taps = target_taps(hf, full, drafter.net.c.target_layers)
        with torch.inference_mode():
            hidden, _ = block_forward(drafter.net, m, full, anchors, anchors >= 0, taps)
        lp, ids = tree_sim.root_tops(hidden[0], drafter.head, 4, drafter.vocab)
        # the simulation's rounds, one by one, against the engine's committed tokens per round
        root, sim = plen - 1, []
        answer = full[0].numpy()
        while root < len(answer) - 1:
            toks, pars = tree_sim.build(lp[root - plen + 1], ids[root - plen + 1], 16, 4)
            got = min(tree_sim.accepted(toks, pars, answer[root + 1 : root + 9]) + 1,
                      len(answer) - 1 - root)  # fmt: skip
            sim.append(got)
            root += got
        eng = seq.stats.accept_lengths
        assert sum(eng) == sum(sim) == len(seq.output)
        total += len(eng)
        same += sum(a == b for a, b in zip(eng, sim, strict=False))
        # the totals agree closely (a reordered near-tie shifts the rounds after it)
        assert abs(len(sim) - len(eng)) <= max(1, len(eng) // 10), (eng, sim)
    assert same >= 0.7 * total
