"""DDTree construction, mask and walk against brute force (spec section 7)."""

import itertools

import numpy as np
import pytest

from dflash_mlx.tree import build_tree, tree_mask, tree_positions, walk


def random_logprobs(D, V, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(D, V)) * 2
    return x - np.log(np.exp(x).sum(1, keepdims=True))


@pytest.mark.parametrize("D, V, N, seed", [(3, 4, 10, 0), (4, 3, 25, 1), (2, 5, 30, 2), (5, 2, 7, 3)])
def test_tree_is_the_n_best_prefixes(D, V, N, seed):
    lp = random_logprobs(D, V, seed)
    tree = build_tree(7, lp, N)
    # Brute force: every prefix of every length, scored by the sum of its log-probs.
    prefixes = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    scores = {p: sum(lp[k, t] for k, t in enumerate(p)) for p in prefixes}
    best = sorted(prefixes, key=lambda p: -scores[p])[: min(N, len(prefixes))]
    # Reconstruct each node's token path from the parents.
    paths = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        paths.append(tuple(reversed(path)))
    assert len(tree) == 1 + len(best)
    assert sorted(paths) == sorted(best)
    for i, p in enumerate(paths, 1):
        assert tree.depths[i] == len(p)
        assert tree.scores[i] == pytest.approx(scores[p])
        assert tree.parents[i] < i  # parents before children
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0


def test_mask_and_positions():
    tree = build_tree(1, random_logprobs(3, 3, 4), 6)
    mask = np.array(tree_mask(tree, prefix=5))
    assert mask.shape == (7, 12) and mask[:, :5].all()
    for i in range(len(tree)):
        seen = {i}
        j = tree.parents[i]
        while j >= 0:
            seen.add(j)
            j = tree.parents[j]
        assert {j for j in range(len(tree)) if mask[i, 5 + j]} == seen
    assert np.array(tree_positions(tree, 40)).tolist() == [40 + d for d in tree.depths]


def test_walk_accepts_the_longest_agreeing_path():
    # Root 1; a chain 2 -> 3 and a branch 5 under the root.
    lp = np.log(np.array([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1 + 0.05],
                          [0.1, 0.1, 0.1, 0.4, 0.2, 0.1],
                          [0.1, 0.1, 0.1, 0.1, 0.5, 0.1]]))
    tree = build_tree(1, lp, 4)
    index = {tuple(tree.tokens[j] for j in _path(tree, i)): i for i in range(len(tree))}
    assert (2,) in index and (2, 3) in index and (5,) in index
    targets = [0] * len(tree)
    targets[0], targets[index[(2,)]], targets[index[(2, 3)]] = 2, 3, 9
    path, tokens = walk(tree, targets)
    assert path == [0, index[(2,)], index[(2, 3)]] and tokens == [2, 3, 9]
    targets[0] = 8  # the target disagrees at once: only its own token
    assert walk(tree, targets) == ([0], [8])


def _path(tree, i):
    out = []
    while i > 0:
        out.append(i)
        i = tree.parents[i]
    return list(reversed(out))
