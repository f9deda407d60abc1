"""Sample-and-match is lossless: with a drafter, token samples follow the target's law.

Two-sample chi-square tests with fixed seeds on the joint law of the first three
generated tokens. A control shows the test can fail: a slightly different
temperature is detected.
"""

from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler
from scipy.stats import chi2_contingency

from dflash_mlx import GenerationStats, generate_step
from conftest import ScriptedDrafter, mlx_lm_greedy, tiny_target

PROMPT = [1, 5, 9]
VOCAB = 16
RUNS = 800
B = 4


def _first_three(target, drafter, temp, seed, stats=None):
    mx.random.seed(seed)
    sampler = make_sampler(temp)
    counts = Counter()
    for _ in range(RUNS):
        tokens = []
        for step in generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter, sampler=sampler,
                                  max_tokens=3, block_size=B if drafter else None, stats=stats):
            tokens += step.tokens
        counts[tuple(tokens)] += 1
    return counts


def _p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test of homogeneity; rare outcomes are pooled into one bin."""
    total = a + b
    keep = [k for k, n in total.items() if n / 2 >= min_expected]
    rows = [[c[k] for k in keep] + [sum(v for k, v in c.items() if k not in keep)] for c in (a, b)]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return chi2_contingency(rows)[1]


@pytest.fixture(scope="module")
def target_and_drafter():
    model, target = tiny_target("qwen3", vocab=VOCAB, hidden=32, layers=2, seed=7, scale=1.5)
    sequence = PROMPT + mlx_lm_greedy(model, PROMPT, 8)
    # Drafts the greedy continuation: often right at T > 0, sometimes partly, sometimes not.
    drafter = ScriptedDrafter(sequence, correct=B - 1, block_size=B, vocab=VOCAB, check_anchor=False)
    return target, drafter


def test_sampling_with_drafter_matches_target(target_and_drafter):
    target, drafter = target_and_drafter
    stats = GenerationStats(block_size=B)
    plain = _first_three(target, None, 1.0, seed=11)
    spec = _first_three(target, drafter, 1.0, seed=12, stats=stats)
    # All acceptance paths occurred, so the test covers them.
    assert stats.histogram[0] > 0 and stats.histogram[1] > 0 and stats.histogram[2] > 0
    assert _p_value(plain, spec) > 0.01


def test_chi_square_detects_a_different_law(target_and_drafter):
    target, _ = target_and_drafter
    assert _p_value(_first_three(target, None, 1.0, seed=11), _first_three(target, None, 0.7, seed=13)) < 0.01
