"""The cost model picks the verify width with the most expected tokens per second.

Every timing here is given (a Calibration and step seconds passed in), so nothing
depends on the machine.
"""

import pytest

from dflash_mlx.decode.calibration import Calibration, chain_block
from dflash_mlx.decode.cost import CostModel


def calibrated(block_size, verify, draft=None, contexts=(32, 256), **kw) -> CostModel:
    """A cost model with given seconds: ``verify`` {n: s or (s0, s1)}, ``draft`` {D: s or (s0, s1)};
    a chain step of n costs the forward of n plus the pass at its block, a plain step the forward."""
    pair = lambda t: tuple(t) if isinstance(t, (tuple, list)) else (t, t)  # noqa: E731
    verify = {n: pair(t) for n, t in verify.items()}
    draft = {b: pair(t) for b, t in (draft if draft is not None else {block_size: 1.0}).items()}
    partial = Calibration(verify, draft, {2: (1.0, 1.0)}, contexts)
    chain = {n: tuple(partial.forward(n, c) + (partial.draft(chain_block(n, sorted(draft)), c) if n > 1 else 0.0)
                      for c in contexts)
             for n in sorted(set(verify) | set(draft)) if n <= max(draft)}
    m = CostModel(block_size=block_size, **kw)
    m.calibrate(Calibration(verify, draft, chain, contexts))
    return m


def observe(m, blocks, right, start=0):
    """``blocks`` blocks of B-1 drafts whose first ``right`` are right."""
    B = m.block_size
    for s in range(blocks):
        m.record_drafts(start + s * B, [7] * (B - 1))
        m.record_committed([7] * right + [8] * (B - right), start + s * B)


def test_shadow_acceptance_resolves_blocks_against_committed_tokens():
    m = CostModel(block_size=5, acceptance_decay=0.5)
    m.record_drafts(10, [1, 2, 3, 4])
    m.record_committed([1, 2], offset=10)  # positions 10, 11: both right, 12.. unknown
    assert len(m.pending) == 1
    m.record_committed([1, 2, 9, 4], offset=10)  # position 12 wrong: 2 right, the 4th draft never tried
    assert m.pending == [] and m.tried == [1, 1, 1, 0] and m.right == [1, 1, 0, 0]
    m.record_drafts(14, [5, 6, 7, 8])
    m.record_committed([1, 2, 9, 4, 5, 6, 7, 8], offset=10)  # all four right
    assert m.tried == [1.5, 1.5, 1.5, 1.0] and m.right == [1.5, 1.5, 1.0, 1.0]


def test_a_short_block_is_censored_where_it_ends():
    m = CostModel(block_size=5, acceptance_decay=1.0)
    m.record_drafts(0, [1])  # a block of 2: one draft, right
    m.record_committed([1, 2], offset=0)
    assert m.tried == [1, 0, 0, 0] and m.right == [1, 0, 0, 0]
    # c(1) = (1 + pooled) / 2 with pooled = (1 + 0.6) / 2; positions it did not reach lean on
    # the one before (a prior worth one block of c(j-1)).
    c1 = (1 + 0.8) / 2
    assert m.survival() == pytest.approx([c1, c1 ** 2, c1 ** 3, c1 ** 4])


def test_expected_tokens_follow_the_survival_function():
    m = CostModel(block_size=4, acceptance_decay=1.0)  # only the newest block counts
    m.record_drafts(0, [1, 2, 3])
    m.record_committed([1, 2, 0], offset=0)  # 2 right, the third tried and wrong
    pooled = (2 + 0.6) / (3 + 1)
    c1 = (1 + pooled) / 2
    c2 = (1 + c1) / 2
    c = [c1, c2, c2 / 2]  # each leans on the one before
    survival = [c[0], c[0] * c[1], c[0] * c[1] * c[2]]
    assert m.survival() == pytest.approx(survival)
    assert m.expected_tokens(1) == 1.0
    assert m.expected_tokens(4) == pytest.approx(1 + sum(survival))


def test_a_fresh_model_hopes_for_acceptance_of_0_6_per_draft():
    assert CostModel(block_size=4).survival() == pytest.approx([0.6, 0.36, 0.216])


def test_plain_decoding_wins_when_drafts_are_wrong_and_speculation_when_right():
    wrong = calibrated(8, {1: 1.0, 8: 2.0}, {8: 1.0})
    observe(wrong, 50, right=0)
    assert wrong.best_width() == 1
    right = calibrated(8, {1: 1.0, 8: 2.0}, {8: 1.0})
    observe(right, 50, right=7)
    assert right.best_width() == 8  # 8 tokens in 3 s beats 1 in 1 s
    assert right.rate(8) == pytest.approx(right.expected_tokens(8) / 3.0)


def test_calibration_interpolates_widths_and_extends_the_context():
    cal = Calibration({1: (1.0, 2.0), 4: (1.6, 4.0), 16: (4.0, 10.0)}, {16: (0.5, 0.5)}, {16: (4.5, 10.5)}, (0, 100))
    assert cal.forward(1, 0) == 1.0 and cal.forward(2, 0) == pytest.approx(1.2)
    assert cal.forward(10, 0) == pytest.approx(2.8)
    assert cal.forward(4, 50) == pytest.approx(2.8) and cal.forward(4, 200) == pytest.approx(6.4)
    assert cal.forward(64, 0) == 4.0  # flat past the largest timed width
    capped = Calibration({1: (3.0, 3.0), 4: (2.0, 2.0)}, {2: (1.0, 1.0)}, {2: (1.0, 1.0)}).capped()
    assert capped.verify_s[1] == (2.0, 2.0)  # more tokens never cost less
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.from_dict({"verify_s": {"1": [0.0, 1.0]}, "draft_s": {"2": [1, 1]}, "chain_s": {"2": [1, 1]},
                               "contexts": [0, 1]})


def test_a_chain_is_drafted_at_the_smallest_timed_block_that_holds_it_and_now_and_then_wider():
    m = calibrated(16, {1: 1.0, 16: 2.0}, {2: 0.1, 4: 0.2, 8: 0.4, 16: 0.8}, wide_every=4)
    assert [m.draft_block(n) for n in (2, 3, 4, 5, 8, 9, 16)] == [2, 4, 4, 8, 8, 16, 16]
    assert m.estimate("chain", 5, 0) == pytest.approx(m.calibration.chain(8, 0))  # its block's step, timed
    assert m.estimate("tree", 9, 0) == pytest.approx(m.calibration.forward(9, 0) + 0.8)  # trees draft the block
    assert [m.probe_block(4) for _ in range(8)] == [4, 4, 4, 8] * 2  # now and then one size up
    assert [m.probe_block(8) for _ in range(4)] == [8, 8, 8, 16] and m.probe_block(16) == 16


def test_the_machine_speed_is_shared_by_every_mode():
    # A busy spell while chains run slows the plain estimate alike: the choice holds.
    m = calibrated(8, {1: 1.0, 8: 1.2}, {8: 0.3})
    observe(m, 50, right=2)
    before = m.best_width()
    for _ in range(30):
        m.record_step("chain", before, 2.5 * m.estimate("chain", before, 0), 0)
    assert m.speed.value == pytest.approx(2.5, rel=0.05)
    assert m.best_width() == before
    assert m.step_seconds("plain", 1, 0) == pytest.approx(2.5, rel=0.05)


def test_what_the_calibration_got_wrong_between_widths_is_learned_at_switches():
    # Timed: a chain of 4 at 1.2 s, of 8 at 2.0 s; so with drafts right 4 times in a
    # row, chains of 4 look best. Really a chain of 8 takes 1.2 s too, on a machine
    # 1.7x slower than when it was timed.
    m = calibrated(8, {1: 1.0, 4: 1.0, 8: 1.0}, {4: 0.2, 8: 1.0})
    observe(m, 50, right=4)
    assert m.best_width() == 4
    for width in [4, 8] * 6:
        for _ in range(3):
            m.record_step("chain", width, 1.7 * 1.2, 0)
    assert m.best_width() == 8
    for width in (4, 8):  # speed times the width's factor: the real step
        assert m.step_seconds("chain", width, 0) == pytest.approx(1.7 * 1.2, rel=0.05)


def test_a_run_of_one_width_and_its_first_step_teach_its_factor_nothing():
    m = calibrated(8, {1: 1.0, 4: 1.0, 8: 1.0}, {4: 0.2, 8: 1.0})
    m.record_step("chain", 4, 1.2, 0)
    m.record_step("chain", 8, 2.5 * 2.0, 0)  # a width's first step in a process compiles
    assert m.width_factor == {}
    for _ in range(30):  # a busy spell while one width runs: the speed moves, not the factor
        m.record_step("chain", 8, 2.5 * 2.0, 0)
    assert m.width_factor == {} and m.speed.value == pytest.approx(2.5, rel=0.05)
    m.record_step("chain", 4, 2.5 * 1.2, 0)  # back to 4 at the same speed: nothing to correct
    assert m.width_factor[4].value == pytest.approx(1.0, rel=0.05)
    short, long = (calibrated(8, {1: 1.0, 8: 1.0}, {8: 1.0}) for _ in range(2))
    for m, steps in ((short, 1), (long, 32)):
        m.record_step("chain", 8, 2.0, 0)
        m.record_step("plain", 1, 1.5, 0, steps=steps)  # plain steps half again slower than timed
    assert 1 not in short.width_factor  # a first plain step alone may be compiling
    assert long.width_factor[1].value > 1.1  # a long run's first compile is spread thin


def test_a_chain_step_costs_what_it_was_timed_at_and_a_wide_probe_its_extra_drafting():
    m = calibrated(16, {1: 1.0, 16: 2.0}, {4: 0.2, 16: 0.8})
    assert m.estimate("chain", 4, 0) == pytest.approx(m.calibration.chain(4, 0))
    # a narrower verify of the same drafted block costs the timed step: no interpolated saving
    assert m.estimate("chain", 3, 0) == pytest.approx(m.calibration.chain(4, 0))
    assert m.estimate("chain", 4, 0, block=16) == pytest.approx(m.calibration.chain(4, 0) + 0.6)
    assert m.estimate("plain", 1, 0) == 1.0


def test_the_best_chain_verifies_a_whole_timed_block():
    # Drafts right 5 times in a row: verifying 6 of a block of 8 is taken to cost the
    # block's timed step, so the whole block (more tokens when a run goes longer) wins.
    m = calibrated(16, {1: 1.0, 4: 1.1, 8: 1.3, 16: 2.0}, {2: 0.1, 4: 0.2, 8: 0.4, 16: 0.8})
    observe(m, 50, right=5)
    assert m.best_width() == 8
    assert m.rate(6, 0) < m.rate(8, 0) and m.rate(3, 0) < m.rate(4, 0)


def test_a_probe_costs_a_plain_step_and_its_drafting():
    # A probe (a plain step that drafts too) is judged against both, so it does not
    # read as a slow machine.
    m = calibrated(16, {1: 1.0, 16: 2.0}, {4: 0.2, 16: 0.8})
    assert m.estimate("plain", 1, 0, block=4) == pytest.approx(1.0 + 0.2)
    m.record_step("plain", 1, 1.2, 0, block=4)
    assert m.speed.value == pytest.approx(1.0)


def test_an_overhead_per_step_favours_wider_verifies():
    m = calibrated(8, {1: 1.0, 8: 2.0}, {8: 1.0})
    observe(m, 50, right=1)
    assert m.best_width() == 1
    for _ in range(30):
        m.record_step("chain", 8, m.estimate("chain", 8, 0), 0, overhead=2.0)
    assert m.step_seconds("plain", 1, 0) == pytest.approx(1.0 + 2.0, rel=0.05)  # plain borrows the chain's
    assert m.best_width() > 1


def test_a_step_far_off_its_estimate_is_not_a_timing():
    m = calibrated(8, {1: 1.0, 8: 2.0}, {8: 1.0})
    m.record_step("chain", 8, 100.0, 0)  # the first run of a new shape compiles
    assert m.speed.value == 1.0 and m.mode_factor == {}


def test_the_context_raises_wide_verifies_most():
    m = calibrated(16, {1: (1.0, 1.1), 16: (1.2, 8.0)}, {16: (0.2, 0.2)}, contexts=(0, 1000))
    observe(m, 50, right=15)
    assert m.best_width(context=0) == 16
    assert m.best_width(context=4000) == 1  # 16 tokens' attention over 4000 rows: slower than one at a time


def test_probes_while_plain_space_out_and_restart_after_speculation():
    m = CostModel(block_size=4, probe_every=3, max_probe_every=6)
    gaps = []
    for _ in range(4):
        gaps.append(m.plain_steps_before_probe())
        m.since_probe += gaps[-1]
        m.probed()
    assert gaps == [2, 5, 5, 5]  # a probe after 3 steps, then 6, then 6 (the cap)
    m.probed(close=True)
    assert m.probe_gap == 6  # winning by little: no further apart
    m.speculating()
    assert m.plain_steps_before_probe() == 2


def test_a_block_better_than_expected_brings_the_next_probe_close():
    m = CostModel(block_size=4, probe_every=3, max_probe_every=12)
    for _ in range(3):
        m.probed()
    assert m.probe_gap == 12
    m.record_drafts(0, [1, 2, 3])
    m.record_committed([1, 2, 3, 4], offset=0)  # all right: the drafts fit the text again
    assert m.probe_gap == 3


def test_tree_expectation_is_calibrated_by_the_chain():
    m = CostModel(block_size=4, acceptance_decay=1.0)
    m.record_drafts(0, [1, 2, 3])
    m.record_committed([1, 9, 0], offset=0)  # 1 right, the second tried and wrong
    pooled = (1 + 0.6) / (2 + 1)
    c1 = (1 + pooled) / 2
    c = [c1, c1 / 2, c1 / 2]  # the third, never tried, leans on the second
    S = [c[0], c[0] * c[1], c[0] * c[1] * c[2]]
    assert m.survival() == pytest.approx(S)
    # The drafter's top-1 chain says 0.8, 0.4, 0.2; a second node at depth 1 has 0.1.
    nodes = [(1, 0.8), (2, 0.4), (3, 0.2), (1, 0.1)]
    expected = 1 + min(1, 0.8 * S[0] / 0.8) + 0.4 * S[1] / 0.4 + 0.2 * S[2] / 0.2 + 0.1 * S[0] / 0.8
    assert m.tree_expected_tokens(4, nodes, [0.8, 0.4, 0.2]) == pytest.approx(expected)
    m.record_tree(4, predicted=2.0, observed=1.0)
    assert m.tree_expected_tokens(4, nodes, [0.8, 0.4, 0.2]) == pytest.approx(expected / 2)
