"""Best-first draft tree construction (DDTree) and its attention mask.

Node 0 is the root (the last committed token, whose KV is not yet cached); nodes 1..n are
draft tokens. Candidates are (depth, rank) choices: rank r at depth d is the drafter's r-th
most likely token at that depth, and a node's weight logw is the sum of log-probs on its
path. A max-heap pops the best candidate, then pushes its next sibling (rank+1) and its
first child (rank 0 at depth+1), until `budget` nodes exist. Parents always precede their
children, and children of one parent are created in descending-logw order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Tree:
    tokens: list[int]  # [n+1]  token of each node, tokens[0] = root
    parents: list[int]  # [n+1]  parents[0] = -1
    depths: list[int]  # [n+1]  depths[0] = 0
    node_logws: list[float]  # [n+1]  path log-weight, 0.0 at the root
    first_child: list[int]  # [n+1]  -1 = leaf   (retrieve_next_token)
    next_sibling: list[int]  # [n+1] -1 = last  (retrieve_next_sibling)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        out, c = [], self.first_child[node]
        while c != -1:
            out.append(c)
            c = self.next_sibling[c]
        return out


def build_tree(root_token: int, logprobs: torch.Tensor | None, budget: int, topk: int) -> Tree:
    """Best-first tree of at most `budget` draft nodes from per-depth log-probs [L, V]."""
    if logprobs is None or budget <= 0 or logprobs.shape[0] == 0:
        return build_tree_top(root_token, [], [], 0)
    # logprobs: [L, V] -> the topk candidates of every depth, sorted by descending log-prob
    k = min(topk, logprobs.shape[1])
    top_lp, top_ids = torch.topk(logprobs.float(), k, dim=-1)  # [L, k]
    return build_tree_top(root_token, top_lp.tolist(), top_ids.tolist(), budget)


def build_tree_top(
    root_token: int, top_lp: list[list[float]], top_ids: list[list[int]], budget: int
) -> Tree:
    """`build_tree` from each depth's k best (log-prob, token) pairs, best first."""
    tree = Tree([root_token], [-1], [0], [0.0], [-1], [-1])
    if budget <= 0 or not top_lp:
        return tree
    k = len(top_lp[0])
    depth_limit = len(top_lp)
    last_child = [-1]  # last created child of each node, to append siblings in order
    # heap entries: (-logw, tie, depth, rank, parent)
    heap: list[tuple[float, int, int, int, int]] = []
    tie = 0

    def push(depth: int, rank: int, parent: int) -> None:
        nonlocal tie
        lp = top_lp[depth - 1][rank]
        if lp == float("-inf"):
            return  # the drafter has no candidate of this rank at this depth
        heapq.heappush(heap, (-(tree.node_logws[parent] + lp), tie, depth, rank, parent))
        tie += 1

    push(1, 0, 0)
    while heap and tree.size - 1 < budget:
        neg_logw, _, depth, rank, parent = heapq.heappop(heap)
        node = tree.size
        tree.tokens.append(top_ids[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.node_logws.append(-neg_logw)
        tree.first_child.append(-1)
        tree.next_sibling.append(-1)
        last_child.append(-1)
        if last_child[parent] == -1:
            tree.first_child[parent] = node
        else:
            tree.next_sibling[last_child[parent]] = node
        last_child[parent] = node
        if rank + 1 < k:
            push(depth, rank + 1, parent)
        if depth < depth_limit:
            push(depth + 1, 0, node)
    return tree


def accept(tree: Tree, targets: list[int]) -> tuple[list[int], int]:
    """The accept rule, for greedy and sampling alike: `targets[i]` is the target's token at
    node i (argmax, or a sample); walk from the root while that token is a child; the first
    token that is not is the bonus. Each emitted token is the target's own draw given the
    accepted path, so the output follows the target distribution exactly.
    Returns (accepted node indices, bonus token)."""
    path, node = [], 0
    while True:
        want = targets[node]
        child = tree.first_child[node]
        while child != -1 and tree.tokens[child] != want:
            child = tree.next_sibling[child]
        if child == -1:
            return path, want
        path.append(child)
        node = child


def ancestor_mask(tree: Tree, width: int | None = None) -> np.ndarray:
    """[W, W] bool (W = width or the tree's size): mask[i, j] = node j is node i or one of
    its ancestors. Rows past the tree (padding to a fixed width) see only themselves."""
    n = tree.size
    width = width or n
    mask = np.zeros((width, width), dtype=bool)
    for i, p in enumerate(tree.parents):  # parents precede children
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    pad = np.arange(n, width)
    mask[pad, pad] = True
    return mask


def tree_mask(tree: Tree, device=None) -> torch.Tensor:
    """[n+1, n+1] bool torch tensor of `ancestor_mask`."""
    mask = torch.from_numpy(ancestor_mask(tree))
    return mask.to(device) if device is not None else mask
