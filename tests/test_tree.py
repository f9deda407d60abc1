"""DDTree construction, mask and walk against brute force (spec section 7)."""

import itertools

import numpy as np
import pytest

from dflash_mlx.decode.tree import build_tree, walk


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


def test_a_smaller_budget_is_a_prefix_of_the_tree():
    logprobs = np.log(np.random.default_rng(3).dirichlet(np.ones(12), size=5))
    big = build_tree(7, logprobs, 40)
    for n in (1, 8, 16, 40):
        assert big.prefix(n) == build_tree(7, logprobs, n)


def test_ancestors_are_each_nodes_path_to_the_root():
    tree = build_tree(1, random_logprobs(3, 3, 4), 6)
    inside = np.array(tree.ancestors())
    assert inside.shape == (7, 7)
    for i in range(len(tree)):
        seen = {i}
        j = tree.parents[i]
        while j >= 0:
            seen.add(j)
            j = tree.parents[j]
        assert {j for j in range(len(tree)) if inside[i, j]} == seen
        assert tree.depths[i] == len(seen) - 1


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


# -- the target side: one forward over a tree, and compaction -------------------

import mlx.core as mx  # noqa: E402

from conftest import tiny_target  # noqa: E402
from test_rollback import assert_same_cache  # noqa: E402

TREE_FAMILIES = ["llama", "llama-sliding", "qwen3", "qwen3_moe"]


def _chain(target, prefix_ids, path_tokens, B):
    cache = target.make_cache(B)
    target(mx.array([prefix_ids]), cache)
    h, _ = target(mx.array([path_tokens]), cache)
    return target.lm_head(h)[0], cache


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_chain_through_the_tree_path_is_bit_identical(family):
    model, target = tiny_target(family)
    ids = [(5 * i + 3) % 250 for i in range(30)]
    a, b = target.make_cache(16), target.make_cache(16)
    target(mx.array([ids[:20]]), a)
    target(mx.array([ids[:20]]), b)
    h1, f1 = target(mx.array([ids[20:]]), a, [1])
    L = len(ids) - 20
    tree = (np.arange(20, 30), np.tril(np.ones((L, L), dtype=bool)))
    h2, f2 = target(mx.array([ids[20:]]), b, [1], tree=tree)
    assert mx.array_equal(h1, h2).item() and mx.array_equal(f1, f2).item()


@pytest.mark.parametrize("family", TREE_FAMILIES)
@pytest.mark.parametrize("prompt_len", [12, 300])  # 300: sliding layers past their window
def test_tree_verify_gives_each_node_its_path_and_compaction_is_exact(family, prompt_len):
    _, target = tiny_target(family)
    ids = [(7 * i + 3) % 250 for i in range(prompt_len)]
    tree = build_tree(ids[-1], random_logprobs(5, 256, seed=prompt_len), budget=12)
    cache = target.make_cache(len(tree))
    target(mx.array([ids[:-1]]), cache)
    start = cache[0].offset
    h, _ = target(mx.array([tree.tokens]), cache, None,
                  tree=(start + np.array(tree.depths), tree.ancestors()))
    logits = target.lm_head(h)[0]
    paths = {i: _path(tree, i) for i in range(len(tree))}
    for i, path in paths.items():
        chain_logits, _ = _chain(target, ids[:-1], [tree.tokens[j] for j in [0] + path], len(tree))
        assert mx.allclose(logits[i], chain_logits[-1], rtol=1e-5, atol=1e-5).item(), f"node {i}"
    # Keep the deepest path: the cache equals one that only saw it.
    deepest = max(paths, key=lambda i: len(paths[i]))
    keep = [0] + paths[deepest]
    target.compact(cache, len(tree), keep)
    _, clean = _chain(target, ids[:-1], [tree.tokens[j] for j in keep], len(tree))
    mx.eval([c.state for c in cache], [c.state for c in clean])
    assert_same_cache(cache, clean)


def test_tree_is_refused_for_families_without_it():
    from dflash_mlx import InputError

    _, target = tiny_target("qwen3_5")
    cache = target.make_cache(4)
    with pytest.raises(InputError, match="tree verification is not available for Qwen35Adapter"):
        target(mx.array([[1, 2]]), cache, None, tree=(np.array([0, 1]), np.tril(np.ones((2, 2), dtype=bool))))
