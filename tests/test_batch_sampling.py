"""Sampled output of a batch follows the target's exact law: the first three tokens of
many sequences decoded 8 at a time (sample-and-match, scripted drafts fully, partly and
not accepted) against the enumerated law (chi-square, fixed seeds), as
tests/test_sampling.py checks one sequence at a time; the control shows power."""

from collections import Counter

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.sampling import Sampling
from test_sampling import B, PROMPT, RUNS, SPEC_RUNS, dflash2, exact_law, p_value, setup  # noqa: F401 (fixtures)

BATCH = 8


def batched_first_three(target, drafter, sampler, seed, runs=RUNS):
    """First three tokens of ``runs`` sequences, ``BATCH`` joining together each round.
    Returns (counts, the acceptance histogram pooled over every sequence, the rules used)."""
    mx.random.seed(seed)
    counts, histogram = Counter(), Counter()
    for _ in range(runs // BATCH):
        decoder = BatchDecoder(target, drafter, B)
        out = {}
        for k in range(BATCH):
            joining = decoder.start(k, PROMPT, sampler, StopCondition(3))
            out[k] = list(joining.advance().tokens)
        stats = [s.stats for s in decoder.sequences]
        rules = {s.rule.name for s in decoder.sequences}
        while len(decoder):
            keys = [s.key for s in decoder.sequences]
            for key, r in zip(keys, decoder.step()):
                out[key] += r.tokens
        for s in stats:
            histogram.update(s.histogram)
        counts.update(tuple(t) for t in out.values())
    return counts, histogram, rules


def test_batched_sampling_follows_the_exact_law(setup):  # noqa: F811
    model, target, drafter = setup
    counts, histogram, _ = batched_first_three(target, drafter, make_sampler(1.0), seed=31)
    assert all(histogram.get(k, 0) > 0 for k in (1, 2, 3))  # full, partial and no acceptance
    assert p_value(counts, exact_law(model, 1.0)) > 0.01


def test_batched_chi_square_detects_a_slight_change_of_law(setup):  # noqa: F811
    model, target, drafter = setup
    counts, _, _ = batched_first_three(target, drafter, make_sampler(0.9), seed=32)
    assert p_value(counts, exact_law(model, 1.0)) < 0.01


def test_batched_speculative_sampling_follows_the_exact_law(setup, dflash2):  # noqa: F811
    """A DFlash2 drafter's q (drafted per sequence, its own rule per sequence): standard
    speculative sampling in a batch keeps the target's law."""
    model, target, _ = setup
    counts, histogram, rules = batched_first_three(target, dflash2, Sampling(1.0, top_p=0.9), seed=33,
                                                   runs=SPEC_RUNS)
    assert rules == {"speculative"}
    assert histogram.get(1, 0) > 0 and sum(n for k, n in histogram.items() if k > 1) > 0
    law = exact_law(model, 1.0, top_p=0.9)
    assert all(law[c] > 0 for c in counts)
    assert p_value(counts, law) > 0.01

