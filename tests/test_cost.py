"""The cost model picks the verify width with the most expected tokens per second."""

import pytest

from dflash_mlx.cost import CostModel


def timed(model, verify, draft):
    for n, t in verify.items():
        model.record_verify(n, t)
    model.record_draft(draft)


def test_shadow_acceptance_resolves_blocks_against_committed_tokens():
    m = CostModel(block_size=5, decay=0.5)
    m.record_drafts(10, [1, 2, 3, 4])
    m.record_committed([1, 2], offset=10)  # positions 10, 11: both right, 12.. unknown
    assert len(m.pending) == 1
    m.record_committed([1, 2, 9, 4], offset=10)  # position 12 wrong: 2 right
    assert m.pending == [] and m.survival_den == 1
    assert m.survival_num == [1, 1, 0, 0]
    m.record_drafts(14, [5, 6, 7, 8])
    m.record_committed([1, 2, 9, 4, 5, 6, 7, 8], offset=10)  # all four right
    assert m.survival_num == [1.5, 1.5, 1.0, 1.0] and m.survival_den == 1.5


def test_expected_tokens_follow_the_survival_function():
    m = CostModel(block_size=4, decay=1.0)  # only the newest block counts
    m.record_drafts(0, [1, 2, 3])
    m.record_committed([1, 2, 0], offset=0)  # 2 right
    survival = [(1 + 0.6) / 2, (1 + 0.36) / 2, 0.216 / 2]  # (n + 0.6^i) / (den + 1)
    assert m.survival() == pytest.approx(survival)
    assert m.expected_tokens(1) == 1.0
    assert m.expected_tokens(4) == pytest.approx(1 + sum(survival))


def test_plain_decoding_wins_when_drafts_are_wrong_and_speculation_when_right():
    wrong = CostModel(block_size=8)
    timed(wrong, {1: 1.0, 8: 2.0}, draft=1.0)
    for s in range(50):
        wrong.record_drafts(s * 8, [0] * 7)
        wrong.record_committed([1] * 8, offset=s * 8)
    assert wrong.best_width() == 1
    right = CostModel(block_size=8)
    timed(right, {1: 1.0, 8: 2.0}, draft=1.0)
    for s in range(50):
        right.record_drafts(s * 8, [1] * 7)
        right.record_committed([1] * 8, offset=s * 8)
    assert right.best_width() == 8  # 8 tokens in 3 s beats 1 in 1 s
    assert right.rate(8) == pytest.approx(right.expected_tokens(8) / 3.0)


def test_verify_seconds_interpolate_and_extrapolate():
    m = CostModel(block_size=16)
    assert m.verify_seconds(4) is None
    timed(m, {1: 1.0, 4: 1.6, 16: 4.0}, draft=0.5)
    assert m.verify_seconds(1) == 1.0 and m.verify_seconds(2) == pytest.approx(1.2)
    assert m.verify_seconds(10) == pytest.approx(2.8)
    assert m.verify_seconds(20) == pytest.approx(4.8)


def test_probes_while_plain_space_out_and_restart_after_speculation():
    m = CostModel(block_size=4, probe_every=3, max_probe_every=6)
    probes = [m.should_probe() for _ in range(15)]
    assert [i for i, p in enumerate(probes) if p] == [2, 8, 14]  # after 3, then 6, then 6 (the cap)
    m.speculating()
    assert [m.should_probe() for _ in range(3)] == [False, False, True]


def test_step_seconds_follow_real_steps():
    m = CostModel(block_size=8, decay=1.0, fresh_steps=2)
    timed(m, {1: 1.0, 8: 2.0}, draft=1.0)
    assert m.step_seconds("plain", 1) == 1.0 and m.step_seconds("chain", 8) == 3.0
    m.record_step("chain", 8, 6.0)  # twice as slow as calibrated
    assert m.step_seconds("chain", 8) == 6.0
    assert m.step_seconds("chain", 4) == pytest.approx(2 * (1.0 + 1 + 3 / 7))  # the mode's ratio
    assert m.step_seconds("plain", 1) == 2.0  # a mode not run yet borrows the observed ratio
    m.record_step("plain", 1, 1.5)
    assert m.step_seconds("plain", 1) == 1.5 and m.ratio["plain"].value == 1.5  # then has its own
    m.record_step("chain", 4, 3.0)
    m.record_step("chain", 4, 3.0)
    assert m.step_seconds("chain", 8) == pytest.approx(3.0 * 3 / (1 + 1 + 3 / 7))  # stale: estimate x ratio


def test_tree_expectation_is_calibrated_by_the_chain():
    m = CostModel(block_size=4, decay=1.0)
    m.record_drafts(0, [1, 2, 3])
    m.record_committed([1, 9, 0], offset=0)  # 1 right
    S = [(1 + 0.6) / 2, 0.36 / 2, 0.216 / 2]
    assert m.survival() == pytest.approx(S)
    # The drafter's top-1 chain says 0.8, 0.4, 0.2; a second node at depth 1 has 0.1.
    nodes = [(1, 0.8), (2, 0.4), (3, 0.2), (1, 0.1)]
    expected = 1 + min(1, 0.8 * S[0] / 0.8) + 0.4 * S[1] / 0.4 + 0.2 * S[2] / 0.2 + 0.1 * S[0] / 0.8
    assert m.tree_expected_tokens(4, nodes, [0.8, 0.4, 0.2]) == pytest.approx(expected)
    m.record_tree(4, predicted=2.0, observed=1.0)
    assert m.tree_expected_tokens(4, nodes, [0.8, 0.4, 0.2]) == pytest.approx(expected / 2)
