import itertools
import math

import pytest
import torch

from ddserve.engine.tree import build_tree, tree_mask


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
