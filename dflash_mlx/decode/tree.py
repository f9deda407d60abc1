"""DDTree (spec section 7): the N most likely draft prefixes of one drafter pass (best first from
a heap, so parents precede children), verified in one target pass at positions ``start + depth``
with an ancestor-only mask, and walked with the target's tokens.
"""

import heapq
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np


@dataclass
class DraftTree:
    """A draft tree in verify order (the root first, parents before children).

    Attributes:
        tokens: [1 + N] token ids, the root (last committed token) first.
        parents: [1 + N] index of each node's parent (-1 for the root).
        depths: [1 + N] depth (0 for the root; a node at depth k drafts block position k).
        scores: [1 + N] sum of the drafter's log-probabilities along the path (0 at the root).
    """

    tokens: List[int]
    parents: List[int]
    depths: List[int]
    scores: List[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, budget: int) -> "DraftTree":
        """The tree of the first ``budget`` nodes besides the root (what :func:`build_tree` gives for it)."""
        n = 1 + budget
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n])

    def children(self) -> List[dict]:
        """Per node, ``{child token: child index}``."""
        out: List[dict] = [{} for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                out[p][self.tokens[i]] = i
        return out

    def ancestors(self) -> np.ndarray:
        """[1+N, 1+N] bool, ``[i, j]`` True where node j is node i or one of its ancestors."""
        n = len(self)
        seen = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i] = seen[p]
            seen[i, i] = True
        return seen


def build_tree(root: int, logprobs: mx.array | np.ndarray, budget: int) -> DraftTree:
    """The ``budget`` (N >= 1) most likely draft prefixes, as a :class:`DraftTree` of ``1 + min(N, D*V)``
    nodes under ``root`` (the last committed token); ``logprobs`` [D, V]: row k-1 is block position k. Each row's
    ``min(N, V)`` best are picked where the array is (one sync, no sort of [D, V] on the host), then ordered there."""
    D, V = logprobs.shape
    k = min(budget, V)
    lp = mx.array(logprobs).astype(mx.float32)
    top = mx.argpartition(-lp, k - 1, axis=1)[:, :k]
    top, values = np.array(top), np.array(mx.take_along_axis(lp, top, axis=1)).astype(np.float64)
    rank = np.lexsort((top, -values), axis=1)  # [D, k] best tokens first
    order, best = np.take_along_axis(top, rank, axis=1), np.take_along_axis(values, rank, axis=1)
    tree = DraftTree([root], [-1], [0], [0.0])
    # Heap entries: (-score, tiebreak, parent index, depth, rank among the parent's candidates).
    heap: List[Tuple[float, int, int, int, int]] = [(-best[0, 0], 0, 0, 1, 0)]
    pushed = 1
    while heap and len(tree) < 1 + budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tree)
        tree.tokens.append(int(order[depth - 1, rank]))
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(score)
        if rank + 1 < k:  # next sibling: same parent, next candidate
            sibling = tree.scores[parent] + best[depth - 1, rank + 1]
            heapq.heappush(heap, (-sibling, pushed, parent, depth, rank + 1))
            pushed += 1
        if depth < D:  # first child: this node, best candidate of the next position
            heapq.heappush(heap, (-(score + best[depth, 0]), pushed, node, depth + 1, 0))
            pushed += 1
    return tree


def walk(tree: DraftTree, targets: Sequence[int]) -> Tuple[List[int], List[int]]:
    """The longest path the target agrees with, given ``targets`` [1+N] (its token after each node):
    ``(path, tokens)``, the node indices kept (root first) and the committed tokens (accepted drafts,
    then the target's token at the last node)."""
    children = tree.children()
    node, path = 0, [0]
    while targets[node] in children[node]:
        node = children[node][targets[node]]
        path.append(node)
    tokens = [tree.tokens[i] for i in path[1:]] + [int(targets[node])]
    return path, tokens


def verify_tree(target, cache: List, capture, choose, tree: DraftTree) -> Tuple[List[int], mx.array]:
    """Verify ``tree`` in one forward at the cache's offset, walk it with ``choose`` (logits [1+N, V] ->
    [1+N] int32) and keep only the accepted path in the cache: ``(tokens, features [1, len(path), F])``.
    Raises RollbackError where the cache cannot keep only that path."""
    positions = cache[0].offset + np.asarray(tree.depths)
    h, features = target(mx.array(tree.tokens, dtype=mx.int32)[None], cache, capture,
                         tree=(positions, tree.ancestors()))
    choice = choose(target.lm_head(h)[0])
    mx.eval(choice, features)
    path, tokens = walk(tree, choice.tolist())
    target.compact(cache, len(tree), path)
    return tokens, mx.take(features, mx.array(path, dtype=mx.int32), axis=1)
