import itertools
import math

import numpy as np
import pytest
import torch

from ddserve.engine.tree import Tree, accept, accept_batch, build_tree, tree_mask


def lp(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


HAND = lp([0.6, 0.3, 0.05, 0.05], [0.1, 0.7, 0.2, 0.0])


def test_heap_order_hand_checked():
    # pops: d1 tok0 (.6) -> d2 tok1 under it (.42) -> d1 tok1 (.3)
    t = build_tree(99, HAND, budget=3, topk=2)
    assert t.tokens == [99, 0, 1, 1]
    assert t.parents == [-1, 0, 1, 0]
    assert t.depths == [0, 1, 2, 1]
    assert [round(math.exp(w), 4) for w in t.node_logws] == [1.0, 0.6, 0.42, 0.3]
    assert t.children(0) == [1, 3] and t.children(1) == [2]


def test_siblings_sorted_by_logw_and_budget_limit():
    # budget 5 adds d2 tok1 under node3 (.21), then d2 tok2 under node1 (.12)
    t = build_tree(99, HAND, budget=5, topk=2)
    assert t.size == 6
    assert t.tokens[4:] == [1, 2] and t.parents[4:] == [3, 1]
    kids = t.children(1)
    assert kids == [2, 5]
    assert t.node_logws[kids[0]] > t.node_logws[kids[1]]


def test_budget_zero_is_root_only_and_topk_one_is_chain():
    assert build_tree(7, HAND, budget=0, topk=4).size == 1
    assert build_tree(7, None, budget=8, topk=4).size == 1
    chain = build_tree(7, HAND, budget=8, topk=1)
    assert chain.tokens == [7, 0, 1] and chain.parents == [-1, 0, 1]  # depth limit L=2


def test_no_candidates_below_minus_inf():
    rows = torch.full((3, 5), float("-inf"))
    rows[0, 2] = 0.0  # only depth 1 has a candidate
    t = build_tree(1, rows, budget=8, topk=4)
    assert t.tokens == [1, 2]


def test_mask_is_ancestors_or_self():
    t = build_tree(99, HAND, budget=5, topk=2)
    m = tree_mask(t)
    for i in range(t.size):
        anc, p = {i}, t.parents[i]
        while p >= 0:
            anc.add(p)
            p = t.parents[p]
        assert set(torch.nonzero(m[i]).flatten().tolist()) == anc


@pytest.mark.parametrize("seed", range(12))
def test_best_first_equals_top_budget_of_full_tree(seed):
    g = torch.Generator().manual_seed(seed)
    L, V, k = 3, 6, 3
    logprobs = torch.log_softmax(torch.randn(L, V, generator=g) * 2, -1)
    budget = int(torch.randint(1, 20, (1,), generator=g))
    t = build_tree(0, logprobs, budget, k)
    # brute force: every path of ranks through the per-depth top-k
    top = torch.topk(logprobs, k, -1).values
    all_w = sorted(
        (
            sum(top[d, r].item() for d, r in enumerate(path))
            for n in range(1, L + 1)
            for path in itertools.product(range(k), repeat=n)
        ),
        reverse=True,
    )
    assert t.size - 1 == min(budget, len(all_w))
    assert sorted(t.node_logws[1:], reverse=True) == pytest.approx(all_w[: t.size - 1], abs=1e-5)
    # parents precede children; children sorted by logw; a DFS over first-child/next-sibling visits each node once
    assert all(t.parents[i] < i for i in range(1, t.size))
    seen, stack = [], [0]
    while stack:
        n = stack.pop()
        seen.append(n)
        kids = t.children(n)
        assert [t.node_logws[c] for c in kids] == sorted(
            (t.node_logws[c] for c in kids), reverse=True
        )
        assert all(t.depths[c] == t.depths[n] + 1 for c in kids)
        stack.extend(kids)
    assert sorted(seen) == list(range(t.size))


@pytest.mark.parametrize("batch", [1, 3, 300])  # walked one by one (<= WALK_ROWS), as arrays
def test_accept_batch_equals_accept_tree_by_tree(batch):
    """The batched walk picks what `accept` picks for every tree of a batch: random trees of
    every shape (chains, bushy, root alone, padded to a common width), targets that follow
    the tree for a while and then leave it, and siblings that share a token (the first made
    wins in both)."""
    gen = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    trees = []
    for i in range(300):
        depth, k, budget = (
            int(rng.integers(1, 6)),
            int(rng.integers(1, 5)),
            int(rng.integers(0, 20)),
        )
        logp = torch.log_softmax(torch.randn(depth, 6, generator=gen), -1)
        t = build_tree(int(rng.integers(0, 6)), logp, budget, k)
        if i % 10 == 0 and len(t.children(0)) > 1:  # two siblings with one token
            a, b = t.children(0)[:2]
            t = Tree.from_parents(
                [x if j != b else t.tokens[a] for j, x in enumerate(t.tokens)],
                t.parents,
                t.node_logws,
            )
        trees.append(t)
    w = max(t.size for t in trees) + 3
    tokens = np.zeros((len(trees), w), np.int64)
    parents = np.full((len(trees), w), -2, np.int64)
    targets = rng.integers(0, 6, (len(trees), w))
    for r, t in enumerate(trees):
        tokens[r, : t.size], parents[r, : t.size] = t.tokens, t.parents
        for node in range(t.size):  # mostly one of the node's children: long paths too
            kids = t.children(node)
            if kids and rng.random() < 0.8:
                targets[r, node] = t.tokens[kids[int(rng.integers(len(kids)))]]
    walked = 0
    for at in range(0, len(trees), batch):
        part = slice(at, at + batch)
        paths, lengths, bonus, ptoks = accept_batch(tokens[part], parents[part], targets[part])
        for r, t in enumerate(trees[part]):
            path, tok = accept(t, targets[at + r, : t.size].tolist())
            assert paths[r, : lengths[r]].tolist() == path and (paths[r, lengths[r] :] == -1).all()
            assert ptoks[r, : lengths[r]].tolist() == [t.tokens[i] for i in path]
            assert bonus[r] == tok
            walked += len(path) > 2
    assert walked > 20  # the walks went deep, not only a node or two
