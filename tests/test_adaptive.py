"""Adaptive verify widths (--block-size auto) and DDTree (--tree-budget) stay lossless.

Greedy output equals mlx-lm's over 200 tokens on tiny llama and qwen3 targets with a
random drafter and with drafters forcing full and partial acceptance; after a tree
run the target cache equals a plain run's, row for row; breaking compaction is
caught; at T > 0 the first three tokens follow the exact law (chi-square).
"""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import GenerationStats, TargetAdapter, generate_step
from dflash_mlx.decode.calibration import FixedTimings, calibrate
from dflash_mlx.protocol import Proposal
from conftest import ScriptedDrafter, assert_varied, mlx_lm_greedy, tiny_drafter, tiny_target
from test_sampling import exact_law, p_value

PROMPT = [1, 17, 33, 2, 9, 100, 42]
N = 200
FAMILIES = ("llama", "llama-sliding", "qwen3")


class TreeScripted(ScriptedDrafter):
    """A scripted drafter with log-probabilities: for the first ``correct`` slots the
    right token has rank ``rank`` (0: the chain's draft; 1: second, so only a tree
    finds it); after them it is absent from the likely candidates."""

    def __init__(self, *args, rank: int = 0, **kw):
        super().__init__(*args, **kw)
        self.rank = rank

    def propose(self, token, context, cache, block_size, sampling=None) -> Proposal:
        pos = cache[0].offset + context.shape[1]
        self.draft(token, context, cache, block_size)  # advances the position like the real one
        lp = np.full((block_size - 1, self.vocab), -30.0, dtype=np.float32)
        for k in range(1, block_size):
            right = self.sequence[pos + k] if pos + k < len(self.sequence) else 0
            others = [(right + j) % self.vocab for j in (1, 2, 3)]
            ranked = others[: self.rank] + [right] + others[self.rank:] if k <= self.correct else others
            for logp, tok in zip(np.log([0.5, 0.3, 0.15, 0.05]), ranked):
                lp[k - 1, tok] = logp
        tokens = mx.array(lp.argmax(axis=-1), dtype=mx.int32)
        return Proposal(tokens, logprobs=mx.array(lp))


_REFERENCES = {}


def reference(family):
    if family not in _REFERENCES:
        model, target = tiny_target(family)
        _REFERENCES[family] = model, target, mlx_lm_greedy(model, PROMPT, N + 16)
    return _REFERENCES[family]


def run(target, drafter, n=N, stats=None, **kw):
    prompt = mx.array(PROMPT, dtype=mx.int32)
    return [t for s in generate_step(prompt, target, drafter, max_tokens=n, stats=stats, **kw) for t in s.tokens]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_is_varied(family):
    assert_varied(reference(family)[2][:N])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["random", "full", "partial", "none"])
def test_auto_block_size_is_lossless(family, kind):
    _, target, ref = reference(family)
    if kind == "random":
        drafter = tiny_drafter(target)
    else:
        correct = {"full": 15, "partial": 5, "none": 0}[kind]
        drafter = ScriptedDrafter(PROMPT + ref, correct=correct, block_size=16, vocab=256)
    stats = GenerationStats(block_size=16)
    assert run(target, drafter, block_size="auto", stats=stats) == ref[:N]
    assert stats.verify["block_size"] == "auto" and sum(stats.widths.values()) > 0
    if kind == "full":
        assert stats.tau > 8  # speculation pays: wide chains


# (mode, width, probe, block drafted, plain steps): plain runs, probes, chains drafted at
# their own block or wider, trees.
CYCLE = [("plain", 1, False, None, 1), ("plain", 1, True, 16, 1), ("chain", 3, False, 4, 1),
         ("chain", 16, False, 16, 1), ("plain", 1, False, None, 3), ("tree", 8, False, 16, 1),
         ("chain", 2, False, 16, 1), ("plain", 1, True, 16, 1), ("tree", 32, False, 16, 1),
         ("chain", 7, False, 8, 1)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("correct,rank", [(15, 0), (5, 0), (7, 1), (0, 0)])
def test_every_switch_between_modes_is_lossless(family, correct, rank, monkeypatch):
    # Whatever the cost model picks: plain steps (with and without probes), chains of
    # any width and trees, in every order, keep the output and the drafter's position.
    import dflash_mlx.decode.policy as policy

    plans = iter([policy.Plan(*CYCLE[i % len(CYCLE)]) for i in range(10 * N)])
    monkeypatch.setattr(policy.Policy, "next", lambda self, context=0: next(plans))
    _, target, ref = reference(family)
    drafter = TreeScripted(PROMPT + ref, correct=correct, block_size=16, vocab=256, rank=rank)
    stats = GenerationStats(block_size=16)
    assert run(target, drafter, block_size="auto", tree_budget=32, stats=stats) == ref[:N]
    assert {"plain", "chain 3", "chain 16", "tree 8", "tree 32", "chain 7"} <= set(stats.widths)


def test_policy_decodes_plainly_when_drafts_are_wrong_and_speculates_when_right():
    from dflash_mlx.decode.cost import CostModel
    from dflash_mlx.decode.policy import Policy

    for right, expected in ((0, "plain"), (15, "chain")):
        cost = CostModel(block_size=16)
        cost.calibrate(FixedTimings().calibrate(None, None, [1, 2, 4, 8, 16], [2, 4, 8, 16]))
        for s in range(40):
            cost.record_drafts(s * 16, [7] * 15)
            cost.record_committed([7] * right + [8] * (16 - right), s * 16)
        policy = Policy(16, True, None, cost)
        plans = [policy.next() for _ in range(40)]
        assert {p.mode for p in plans} == {expected}
        if expected == "plain":
            at, probes = 0, []  # the step index of each probe
            for p in plans:
                probes += [at] if p.probe else []
                at += max(p.steps, 1)
            assert len(plans) < at / 4  # runs of plain steps, not one decision per step
            gaps = [b - a for a, b in zip(probes, probes[1:])]
            assert probes[0] <= 16 and gaps == sorted(gaps) and max(gaps) <= 129  # probes spaced out, growing
            assert len([x for x in probes if x < 512]) <= 7
            assert all(p.block == 4 for p in plans if p.probe)  # drafted at the best chain's block (>= 4)
        else:
            assert plans[0].width == 16 and plans[0].block == 16


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [8, 32, "auto"])
@pytest.mark.parametrize("kind", ["full", "partial", "second", "random"])
def test_tree_is_lossless(family, budget, kind):
    _, target, ref = reference(family)
    if kind == "random":
        drafter = tiny_drafter(target)
    else:
        correct, rank = {"full": (15, 0), "partial": (5, 0), "second": (7, 1)}[kind]
        drafter = TreeScripted(PROMPT + ref, correct=correct, block_size=16, vocab=256, rank=rank)
    stats = GenerationStats(block_size=16)
    block = "auto" if budget == "auto" else None
    assert run(target, drafter, block_size=block, tree_budget=budget, stats=stats) == ref[:N]
    if budget != "auto":
        assert set(stats.widths) == {f"tree {budget}"}
    if kind == "second" and budget == 32:
        assert stats.tau > 3  # the chain's drafts are all wrong; the tree finds the right path


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_after_tree_compaction_equals_a_plain_run(family):
    _, target, ref = reference(family)
    drafter = TreeScripted(PROMPT + ref, correct=7, block_size=16, vocab=256, rank=1)
    tree_cache, plain_cache = target.make_cache(33), target.make_cache(1)
    assert run(target, drafter, n=60, tree_budget=32, prompt_cache=tree_cache) == ref[:60]
    assert run(target, None, n=60, prompt_cache=plain_cache) == ref[:60]
    for a, b in zip(tree_cache, plain_cache):
        assert a.offset == b.offset
        (ka, va), (kb, vb) = held_rows(a), held_rows(b)
        n = min(ka.shape[2], kb.shape[2])
        assert n >= 8
        assert mx.allclose(ka[..., -n:, :], kb[..., -n:, :], atol=1e-5)
        assert mx.allclose(va[..., -n:, :], vb[..., -n:, :], atol=1e-5)


def held_rows(c):
    """(keys, values) [1, H, rows, D] of the rows a layer cache holds, oldest first."""
    rows = getattr(c, "held", c.offset)
    return c.keys[..., :rows, :], c.values[..., :rows, :]


def test_drafter_context_after_a_tree_run_equals_a_chain_run():
    # The drafter cache receives the accepted path's feature rows, nothing else.
    _, target, ref = reference("qwen3")
    drafter = tiny_drafter(target)
    caches = []
    for kw in ({"tree_budget": 16}, {"block_size": 16}):
        cache = drafter.make_cache()
        assert run(target, drafter, n=60, draft_cache=cache, **kw) == ref[:60]
        caches.append(cache)
    for a, b in zip(*caches):
        assert a.offset == b.offset
        assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-4)


def test_broken_compaction_is_caught(monkeypatch):
    _, target, ref = reference("qwen3")

    def keep_first_rows(self, cache, new_rows, keep):  # wrong: the first rows, not the path's
        self.rollback(cache, new_rows - len(keep))

    monkeypatch.setattr(TargetAdapter, "compact", keep_first_rows)
    drafter = TreeScripted(PROMPT + ref, correct=7, block_size=16, vocab=256, rank=1, check_anchor=False)
    assert run(target, drafter, tree_budget=32) != ref[:N]


def test_hybrid_target_keeps_chains_and_says_why():
    model, target = tiny_target("qwen3_5")
    ref = mlx_lm_greedy(model, PROMPT, 60)
    stats = GenerationStats(block_size=16)
    assert run(target, tiny_drafter(target), n=60, tree_budget=32, stats=stats) == ref
    assert stats.verify["tree_budget"] is None and "chains only" in stats.verify["reason"]
    assert "tree off" in stats.verify_line() and all(k.startswith("chain") for k in stats.widths)


VOCAB, B = 16, 4


def first_three(target, drafter, seed, runs=1500, stats=None, **kw) -> Counter:
    mx.random.seed(seed)
    counts = Counter()
    prompt = mx.array([1, 5, 9], dtype=mx.int32)
    for _ in range(runs):
        tokens = [t for s in generate_step(prompt, target, drafter, sampler=make_sampler(1.0), max_tokens=3, stats=stats, **kw)
                  for t in s.tokens]
        counts[tuple(tokens)] += 1
    return counts


@pytest.mark.parametrize("kw", [{"tree_budget": 6}, {"block_size": "auto"}, {"block_size": "auto", "tree_budget": "auto"}])
def test_sampling_follows_the_exact_law(kw):
    model, target = tiny_target("qwen3", vocab=VOCAB, hidden=32, layers=2, seed=7)
    sequence = [1, 5, 9] + mlx_lm_greedy(model, [1, 5, 9], 8)
    drafter = TreeScripted(sequence, correct=B - 1, block_size=B, vocab=VOCAB, check_anchor=False, rank=1)
    stats = GenerationStats(block_size=B)
    # Verifies cost what a plain step costs: auto keeps verifying, so the law is
    # checked through accepted and rejected drafts, not plain steps only.
    counts = first_three(target, drafter, seed=3, stats=stats, timings=FixedTimings(lambda n: 1e-3, 1e-5), **kw)
    assert stats.accepted > 0 and stats.steps > 0  # drafts were verified and some accepted
    assert p_value(counts, exact_law(model, 1.0)) > 0.01


def test_calibration_times_every_width_on_scratch_caches():
    _, target, ref = reference("qwen3")
    drafter = tiny_drafter(target)
    c = calibrate(target, drafter, [1, 2, 16, 33], [2, 8, 16])
    assert sorted(c.verify_s) == [1, 2, 16, 33] and sorted(c.draft_s) == [2, 8, 16] and sorted(c.chain_s) == [1, 2, 16]
    times = [t for table in (c.verify_s, c.draft_s, c.chain_s) for pair in table.values() for t in pair]
    assert all(t > 0 for t in times) and c.contexts[0] < c.contexts[1]


def test_a_drafter_keeps_what_it_learned_across_generations():
    # The second generation with the same drafter goes on with the first one's cost
    # model (timings and acceptance profile), not a fresh, hopeful one.
    import dflash_mlx.decode.policy as policy

    _, target, ref = reference("qwen3")
    drafter = ScriptedDrafter(PROMPT + ref, correct=0, block_size=16, vocab=256, check_anchor=False)
    first, second = GenerationStats(block_size=16), GenerationStats(block_size=16)
    assert run(target, drafter, n=60, block_size="auto", stats=first) == ref[:60]
    (cost,) = policy._models_of(drafter).values()
    steps, blocks = cost.steps, cost.tried[0]
    assert run(target, drafter, n=60, block_size="auto", stats=second) == ref[:60]
    assert tuple(policy._models_of(drafter).values()) == (cost,)
    # tried[0]: blocks seen, decayed (the chain and two probes: 1 + 0.95 + 0.95^2)
    assert cost.steps > steps and cost.tried[0] > blocks > 2.7 and cost.right[0] < 0.5
    # A fresh model's hopeful prior verifies a chain first; the kept one knows better.
    assert any(k.startswith("chain") for k in first.widths) and set(second.widths) == {"plain"}
    other = tiny_drafter(target)
    assert run(target, other, n=10, block_size="auto") == ref[:10]  # another drafter: its own model
    assert len(policy._MODELS) == 2
    del other
    assert len(policy._MODELS) == 1  # forgotten with its drafter
