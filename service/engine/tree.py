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

    @classmethod
    def from_parents(cls, tokens, parents, logws) -> Tree:
        """A tree from per-node arrays in creation order (ddserve.engine.tree_triton's
        output): nodes up to the first padding row (parent -2); a parent's children come in
        the order they were made (descending weight), as `build_tree_top` links them."""
        parents = list(parents)
        n = parents.index(-2) if -2 in parents else len(parents)
        tree = cls(list(tokens[:n]), parents[:n], [0] * n, list(logws[:n]), [-1] * n, [-1] * n)
        last = [-1] * n
        for i in range(1, n):
            p = parents[i]
            tree.depths[i] = tree.depths[p] + 1
            if last[p] == -1:
                tree.first_child[p] = i
            else:
                tree.next_sibling[last[p]] = i
            last[p] = i
        return tree

    def children(self, node: int) -> list[int]:
        out, c = [], self.first_child[node]
        while c != -1:
            out.append(c)
            c = self.next_sibling[c]
        return out


@dataclass
class DeviceTrees:
    """A round's trees built on the GPU (ddserve.engine.tree_triton), one row per KV slot:
    the verify reads tokens, positions and mask there; parents and weights come back to the
    host with the verify's argmax (one copy) and become `Tree`s for the accept walk."""

    tokens: torch.Tensor  # [B, W] int64
    positions: torch.Tensor  # [B, W] int64  committed length + depth
    parents: torch.Tensor  # [B, W] int64  -1 root, -2 padding
    weights: torch.Tensor  # [B, W] float64  node_logws
    mask: torch.Tensor  # [B, W, W] int64  ancestor mask
    width: int  # W
    bound: int  # the most nodes (root included) any of the trees has

    def for_host(self, n: int) -> list[torch.Tensor]:
        """Tokens, parents and weights (bits as int64) as [1, n] rows to stack and copy."""
        return [
            t.reshape(1, n) for t in (self.tokens, self.parents, self.weights.view(torch.int64))
        ]

    @staticmethod
    def tree(rows: np.ndarray, r0: int, w: int) -> Tree:
        """The tree of the slot whose nodes are columns r0..r0+w of the copied rows."""
        cols = slice(r0, r0 + w)
        return Tree.from_parents(
            rows[0, cols].tolist(), rows[1, cols].tolist(), rows[2, cols].view(np.float64).tolist()
        )


def size_bound(budget: int, depth: int, k: int) -> int:
    """The most draft nodes a tree of `budget` over `depth` positions of `k` candidates has
    (every log-prob finite: exactly that many)."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


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
        if not lp > float("-inf"):
            return  # the drafter has no candidate of this rank at this depth (-inf, NaN)
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


# accept_batch walks up to this many trees one by one in Python, more as arrays (on this
# repository's 2-core CPU the two cost the same at ~20 trees of 8 nodes; 64: 237 vs 92 us)
WALK_ROWS = 16


def accept_batch(
    tokens: np.ndarray, parents: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`accept` for a batch of trees at once, as arrays [N, W] in creation order (node 0 the
    root: parent -1; padding past a tree: parent -2; a parent's children in the order they
    were made). Walks every tree a depth at a time: the child of the current node whose
    token is the target's at it, the first such in creation order, as `accept` picks (up to
    WALK_ROWS trees one by one in Python, the same rule).
    Returns (paths [N, W-1]: accepted node indices, -1 past a path's end; lengths [N];
    bonus tokens [N]; the accepted nodes' tokens [N, W-1], as paths)."""
    n, w = tokens.shape
    paths = np.full((n, max(w - 1, 0)), -1, dtype=np.int64)
    path_tokens = paths.copy()
    if n <= WALK_ROWS:  # a few trees: walked one by one (numpy's per-call cost would dominate)
        lengths, bonus = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        rows = zip(tokens.tolist(), parents.tolist(), targets.tolist(), strict=True)
        for r, (tok, par, tgt) in enumerate(rows):
            cur, d = 0, 0
            while True:
                want = tgt[cur]
                # the first child of `cur` (children follow their parent) with the token
                nxt = next((j for j in range(cur + 1, w) if par[j] == cur and tok[j] == want), 0)
                if not nxt:
                    break
                paths[r, d], path_tokens[r, d], d, cur = nxt, want, d + 1, nxt
            lengths[r], bonus[r] = d, tgt[cur]
        return paths, lengths, bonus, path_tokens
    rows = np.arange(n)
    cur = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for d in range(w - 1):
        want = targets[rows, cur]
        match = (parents == cur[:, None]) & (tokens == want[:, None])
        alive &= match.any(axis=1)
        if not alive.any():
            break
        nxt = match.argmax(axis=1)
        paths[alive, d], path_tokens[alive, d] = nxt[alive], want[alive]
        cur = np.where(alive, nxt, cur)
    lengths = (paths >= 0).sum(axis=1)
    return paths, lengths, targets[rows, cur], path_tokens


def accept_device(tokens, parents, mask, targets):
    """`accept_batch` on the device with no host step (ddserve.engine.static_spec): [B, W]
    tensors of tokens, parents (-1 the root, -2 padding), the trees' ancestor masks [B, W, W]
    (nonzero: the column is the row's node or one of its ancestors) and the target's choices.
    A node is taken where its token is the target's at its parent and no earlier sibling's
    is (the first such child, as `accept` picks), and every ancestor of it is taken: the
    chain from the root. Children come after their parents, so the chain in index order is
    the path. Returns (keep [B, W]: the root, the path's nodes, then each column's own index;
    lengths [B]; bonus tokens [B]): the entries start + keep[j] move to start + j."""
    w = tokens.shape[1]
    idx = torch.arange(w, device=tokens.device)
    good = (parents >= 0) & (tokens == targets.gather(1, parents.clamp(min=0)))
    same = parents[:, :, None] == parents[:, None, :]  # [B, node, other]
    earlier = (same & good[:, None, :] & (idx[None, :] < idx[:, None])).any(-1)
    good = (good & ~earlier) | (idx == 0)
    taken = ~((mask != 0) & ~good[:, None, :]).any(-1)
    lengths = taken.sum(1) - 1
    order = torch.where(taken, idx, idx + w).argsort(1)  # taken nodes first, ascending
    keep = torch.where(idx <= lengths[:, None], order, idx)
    bonus = targets.gather(1, order.gather(1, lengths[:, None]))[:, 0]
    return keep, lengths, bonus


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
