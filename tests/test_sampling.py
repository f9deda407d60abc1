"""Sampling with a drafter is lossless: samples follow the target's exact law.

The joint law of the first three generated tokens is enumerated exactly on a
16-token vocabulary (temperature, top-p, min-p and top-k applied as mlx-lm's sampler
applies them), and DFlash samples are tested against it (chi-square goodness of fit,
fixed seeds): sample-and-match with argmax drafts, and speculative sampling with a
DFlash2 drafter's selector q and a DSpark drafter's Markov-corrected q (also over a reduced
draft vocabulary, and Gemma 4's on a 16-token Gemma 4 target). Controls show the test has power: samples at temperature 0.9 are rejected
as draws from the law at 1.0 (a total-variation distance of about 0.08), and so is speculative
sampling that resamples from p instead of the residual max(p - q, 0) after a rejection, or that
accepts DSpark's drafts by the q before the Markov correction.
"""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler
from scipy.stats import chisquare

from dflash_mlx import GenerationStats, bind_drafter, generate_step
from dflash_mlx.decode.acceptance import SpeculativeRule
from dflash_mlx.drafter.vocab import set_draft_vocab
from dflash_mlx.sampling import Sampling
from conftest import ScriptedDrafter, format_drafter, mlx_lm_greedy, tiny_target

PROMPT = [1, 5, 9]
VOCAB = 16
RUNS = 2000
SPEC_RUNS = 1000  # speculative sampling: each run also drafts with a DFlash2 network
B = 4


def exact_law(model, temp, top_p=1.0, min_p=0.0, top_k=0) -> np.ndarray:
    """[V, V, V] probabilities of the first three tokens, by enumeration."""
    def probs(seqs):
        logits = model(mx.array(seqs))[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < top_p < 1:
            lp = apply_top_p(lp, top_p)
        if min_p:
            lp = apply_min_p(lp, min_p, 1)
        if top_k:
            lp = apply_top_k(lp, top_k)
        return np.array(mx.softmax(lp / temp, axis=-1), dtype=np.float64)

    V = VOCAB
    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(V)])
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def first_three(target, drafter, sampler, seed, stats=None, runs=RUNS) -> Counter:
    mx.random.seed(seed)
    counts = Counter()
    for _ in range(runs):
        tokens = []
        cache = target.make_cache(B)
        for step in generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter, sampler=sampler,
                                  max_tokens=3, block_size=B if drafter else None, stats=stats,
                                  prompt_cache=cache):
            tokens += step.tokens
        # Rejected drafts were rolled back: the cache holds the prompt and all but the last token.
        assert all(c.offset == len(PROMPT) + 2 for c in cache)
        counts[tuple(tokens)] += 1
    return counts


def p_value(counts: Counter, law: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells expected fewer than 5 times are pooled."""
    n = sum(counts.values())
    cells = [c for c in np.ndindex(law.shape) if law[c] * n >= min_expected]
    observed = [counts[c] for c in cells]
    expected = [law[c] * n for c in cells]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def setup():
    model, target = tiny_target("qwen3", vocab=VOCAB, hidden=32, layers=2, seed=7)
    sequence = PROMPT + mlx_lm_greedy(model, PROMPT, 8)
    # Drafts the greedy continuation: often right at T > 0, sometimes partly, sometimes not.
    drafter = ScriptedDrafter(sequence, correct=B - 1, block_size=B, vocab=VOCAB, check_anchor=False)
    return model, target, drafter


def test_sampling_with_drafter_follows_the_exact_law(setup):
    model, target, drafter = setup
    stats = GenerationStats(block_size=B)
    counts = first_three(target, drafter, make_sampler(1.0), seed=12, stats=stats)
    # Full, partial and no acceptance all occurred (so verifies rolled back at T > 0).
    assert all(stats.histogram.get(k, 0) > 0 for k in (1, 2, 3))
    assert p_value(counts, exact_law(model, 1.0)) > 0.01


def test_filters_on_verify_rows_follow_the_exact_law(setup):
    # top-p, min-p and top-k shape every verify row exactly as mlx-lm's sampler does.
    model, target, drafter = setup
    sampler = make_sampler(0.7, top_p=0.9, min_p=0.02, top_k=6)
    counts = first_three(target, drafter, sampler, seed=13)
    law = exact_law(model, 0.7, top_p=0.9, min_p=0.02, top_k=6)
    assert all(law[c] > 0 for c in counts)  # no token outside the filters ever appears
    assert p_value(counts, law) > 0.01


def test_chi_square_detects_a_slight_change_of_law(setup):
    model, target, _ = setup
    law = exact_law(model, 1.0)
    assert 0.05 < 0.5 * np.abs(law - exact_law(model, 0.9)).sum() < 0.1  # truly slight
    assert p_value(first_three(target, None, make_sampler(0.9), seed=14), law) < 0.01


# --- speculative sampling with a DFlash2 drafter (spec section 9) ---------------------

@pytest.fixture(scope="module")
def dflash2(setup):
    """A random 1-layer DFlash2 drafter for the 16-token target: its selector's q over 8
    candidates, logits scaled down so q overlaps p (some drafts are accepted)."""
    return format_drafter(setup[1], "dflash2", block_size=B, num_hidden_layers=1, layer_types=["sliding_attention"],
                          conv_kernel_size=2, selector_top_k=8, output_multiplier=0.2)


@pytest.fixture(scope="module")
def dspark(setup):
    """A random 1-layer DSpark drafter for the 16-token target (anchor-first, trained block B - 1): its
    Markov head (rank 16, weights scaled up so that the correction moves q far) corrects every row."""
    drafter = format_drafter(setup[1], "dspark", block_size=B, num_hidden_layers=1)
    for w in drafter.markov_head.values():
        w.weight = 3 * w.weight
    return drafter


@pytest.fixture(scope="module")
def dspark_vocab(setup, dspark):
    """The DSpark drafter drafting among 8 of the 16 tokens only (a reduced draft vocabulary, FR-Spec's head)."""
    drafter = format_drafter(setup[1], "dspark", block_size=B, num_hidden_layers=1, bind=False)
    drafter.update(dspark.parameters())
    set_draft_vocab(drafter, mx.arange(0, VOCAB, 2))
    return bind_drafter(drafter, setup[1])


@pytest.fixture(scope="module")
def gemma4_target():
    """A 16-token Gemma 4 target (per-layer inputs, KV sharing, MoE, softcap: conftest's gemma4_text)."""
    return tiny_target("gemma4_text", vocab=VOCAB, hidden=32, seed=7)


@pytest.fixture(scope="module")
def gemma4_dspark(gemma4_target):
    """A random 1-layer Gemma 4 DSpark drafter for it, its Markov head scaled up as the DSpark one's."""
    drafter = format_drafter(gemma4_target[1], "gemma4-dspark", block_size=B, num_hidden_layers=1)
    for w in drafter.markov_head.values():
        w.weight = 3 * w.weight
    return drafter


@pytest.mark.parametrize("kind,temp,seed", [("dflash2", 0.7, 21), ("dflash2", 1.0, 22), ("dspark", 0.7, 24),
                                            ("dspark", 1.0, 25), ("dspark_vocab", 1.0, 27),
                                            ("gemma4_dspark", 1.0, 28)])
def test_speculative_sampling_follows_the_exact_law(setup, request, kind, temp, seed):
    model, target = request.getfixturevalue("gemma4_target") if kind.startswith("gemma4") else setup[:2]
    stats = GenerationStats(block_size=B)
    drafter = request.getfixturevalue(kind)
    counts = first_three(target, drafter, Sampling(temp, top_p=0.9), seed=seed, stats=stats, runs=SPEC_RUNS)
    assert stats.acceptance_rule == "speculative"
    # Rejections (residual samples) and acceptances both occurred.
    assert stats.histogram.get(1, 0) > 0 and sum(n for k, n in stats.histogram.items() if k > 1) > 0
    law = exact_law(model, temp, top_p=0.9)
    assert all(law[c] > 0 for c in counts)  # no token outside top-p ever appears
    assert p_value(counts, law) > 0.01


def test_chi_square_detects_resampling_from_p(setup, dflash2, monkeypatch):
    # The classic bug: after a rejection, sample p again instead of max(p - q, 0).
    model, target, _ = setup
    monkeypatch.setattr(SpeculativeRule, "residual", staticmethod(lambda p, q: p))
    counts = first_three(target, dflash2, Sampling(1.0, top_p=0.9), seed=23, runs=300)
    assert p_value(counts, exact_law(model, 1.0, top_p=0.9)) < 0.01


def test_chi_square_detects_dspark_q_without_the_markov_correction(setup, dspark, monkeypatch):
    # Drafts sampled from the corrected q, accepted as if drawn from softmax(logits) before the bias.
    from dflash_mlx import DFlashDrafter

    model, target, _ = setup
    drafts = DFlashDrafter.drafts

    def uncorrected(self, hidden, logits, first, sampling=None, key=None):
        tokens, q = drafts(self, hidden, logits, first, sampling, key)
        return tokens, None if q is None else sampling.probs(logits)

    monkeypatch.setattr(DFlashDrafter, "drafts", uncorrected)
    counts = first_three(target, dspark, Sampling(1.0, top_p=0.9), seed=26, runs=600)
    assert p_value(counts, exact_law(model, 1.0, top_p=0.9)) < 0.01


def acceptance(target, drafter, sampler, seed, runs=3, n=50):
    """Drafts accepted over drafted (and tau) over a few generations."""
    stats = GenerationStats(block_size=B)
    mx.random.seed(seed)
    for _ in range(runs):
        for _ in generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter, sampler=sampler,
                               max_tokens=n, block_size=B, stats=stats):
            pass
    return stats


def test_speculative_acceptance_at_least_sample_and_match(setup, dflash2):
    """At T = 1 on the tiny pair: the selector's q (speculative) against its argmax path
    (sample-and-match, forced by passing mlx-lm's opaque sampler)."""
    _, target, _ = setup
    spec = acceptance(target, dflash2, Sampling(1.0), seed=31)
    match = acceptance(target, dflash2, make_sampler(1.0), seed=31)
    assert (spec.acceptance_rule, match.acceptance_rule) == ("speculative", "sample-and-match")
    print(f"\nT=1 tiny pair: speculative {spec.acceptance_rate:.3f} of drafts accepted (tau {spec.tau:.2f}), "
          f"sample-and-match {match.acceptance_rate:.3f} (tau {match.tau:.2f})")
    assert spec.acceptance_rate >= match.acceptance_rate
