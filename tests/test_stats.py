"""GenerationStats: tau, acceptance rate, histogram, rates, bandwidth and the printed lines."""

import numpy as np
import pytest

from dflash_mlx import GenerationStats
from dflash_mlx.prompt_cache.pair import common_prefix
from dflash_mlx.stats import format_histogram, histogram_dict, pooled


def test_tau_and_histogram_by_acceptance_length():
    s = GenerationStats(block_size=4)
    for a in (3, 0, 1, 3):
        s.record_step(a)
    assert s.histogram == {4: 2, 1: 1, 2: 1}
    assert s.tau == pytest.approx((4 + 1 + 2 + 4) / 4)
    assert s.acceptance_rate == pytest.approx(7 / 12)
    assert format_histogram(s.histogram) == "1:1 2:1 4:2"
    assert histogram_dict(s.histogram) == {"1": 1, "2": 1, "4": 2}


def test_tau_and_rate_are_none_without_verify_steps_and_the_lines_say_why():
    s = GenerationStats(block_size=16)
    assert s.tau is None and s.acceptance_rate is None and format_histogram(s.histogram) == "(no steps)"
    assert s.acceptance_line() == "no draft steps: the reply ended with its first token (from prefill)"
    s.record_plan("plain", 1, 0.01, 0, 0)
    s.record_plan("plain", 1, 0.01, 0, 0)
    assert s.tau is None and s.plain_steps == 2 and s.steps == 0
    assert s.acceptance_line().startswith("no draft steps: decoded plainly (2 plain steps) because block size auto")
    assert s.tau_text() == "no draft steps"
    d = s.to_dict()
    assert d["tau"] is None and d["acceptance_rate"] is None and d["plain_steps"] == 2 and d["steps"] == 0
    assert not any(line.startswith(("Histogram", "Bandwidth")) for line in s.format_lines())


def test_plain_steps_are_counted_apart_from_verify_steps():
    s = GenerationStats(block_size=4)
    s.record_step(3)
    s.record_plan("plain", 1, 0.01, 0, 0)
    assert s.steps == 1 and s.plain_steps == 1 and s.tau == 4.0 and s.histogram == {4: 1}
    assert s.acceptance_line() == ("tau 4.00 tokens/step over 1 verify steps (100.0% of drafts accepted), "
                                   "and 1 plain step")


def test_probe_steps_are_counted_and_said():
    s = GenerationStats(block_size=16, verify={"block_size": "auto", "tree_budget": None, "reason": None})
    s.record_plan("plain", 1, 0.01, 0, 0)
    s.record_plan("chain", 2, 0.02, 0, 1, probe=True)
    s.record_plan("plain", 1, 0.01, 0, 0)
    other = GenerationStats(block_size=16)
    other.record_plan("chain", 4, 0.02, 0, 3, probe=True)
    s.add(other)
    assert s.probe_steps == 2 and s.to_dict()["probe_steps"] == 2
    assert s.verify_line().endswith("; 2 probes among them")
    assert "; block size auto (up to 16)" in s.format_lines()[3]  # not "block size 16": auto ran 2 and 4


def test_acceptance_rate_is_right_when_block_sizes_vary():
    # 3 of 15 drafts at B=16, then 3 of 3 at B=4: 6 of 18, not 6 of 2 x 15.
    s = GenerationStats(block_size=16)
    s.record_step(3, drafted=15)
    s.record_step(3, drafted=3)
    assert s.acceptance_rate == pytest.approx(6 / 18) and s.tau == pytest.approx(4.0)


def test_rates_bandwidth_and_lines():
    s = GenerationStats(block_size=4, prompt_tokens=10, generation_tokens=50, prompt_s=0.5, generation_s=2.0,
                        target_bytes=int(0.75e9), drafter_bytes=int(0.25e9))
    s.record_step(2)
    s.phase_s["decode"] = 0.25
    assert s.prompt_tps == 20 and s.generation_tps == 25
    assert s.bandwidth_gbps == pytest.approx(0.5)  # 1 GB x 1 step / 2 s
    lines = s.format_lines()
    assert lines[0] == "Prompt: 10 tokens, 20.000 tokens-per-sec"
    assert lines[1] == "Generation: 50 tokens, 25.000 tokens-per-sec"
    assert lines[2].startswith("Peak memory: ")
    assert lines[3] == "Acceptance: tau 3.00 tokens/step over 1 verify steps (66.7% of drafts accepted); block size 4"
    assert lines[4] == "Histogram: 3:1"
    assert lines[5] == "Bandwidth: 0.50 GB/s"
    d = s.to_dict()
    assert d["timings_ms"]["decode"] == 250.0 and d["acceptance_histogram"] == {"3": 1}
    assert d["acceptance_rate"] == pytest.approx(0.6667) and d["bandwidth_gbps"] == 0.5
    s.record_plain(0.1)  # a plain step reads the target's weights alone
    assert s.bandwidth_gbps == pytest.approx((1e9 + 0.75e9) / 2 / 1e9)
    assert GenerationStats(block_size=4, target_bytes=10).bandwidth_gbps is None  # no decoding time


def test_prompt_line_with_a_cached_prompt_rates_the_prefilled_tokens():
    s = GenerationStats(block_size=1, prompt_tokens=5, prompt_reused=4, prompt_s=0.5)
    assert s.prompt_prefilled == 1 and s.prompt_tps == 2.0
    assert s.prompt_line() == "Prompt: 5 tokens (4 reused from the prompt cache, 1 prefilled), 2.000 tokens-per-sec"
    d = s.to_dict()
    assert (d["prompt_tokens"], d["prompt_tokens_reused"], d["prompt_tokens_prefilled"]) == (5, 4, 1)


def test_plain_stats_say_speculation_is_off_and_why():
    s = GenerationStats(block_size=1, speculative=False, reason="no drafter was given (--draft-model)")
    lines = s.format_lines()
    assert not any(line.startswith(("Acceptance", "Histogram")) for line in lines)
    assert s.tau_text() is None and s.acceptance_line() is None
    assert "Speculative decoding: off (no drafter was given (--draft-model))" in lines
    assert s.to_dict()["speculative"] is False and s.to_dict()["reason"].startswith("no drafter")


@pytest.mark.parametrize("drafts, targets, a", [
    ([5, 6, 7], [5, 6, 7, 8], 3), ([5, 6, 7], [5, 9, 7, 8], 1), ([5, 6, 7], [1, 6, 7, 8], 0),
])
def test_count_accepted(drafts, targets, a):
    assert common_prefix(drafts, targets) == a


def test_add_and_pooled_accumulate_generations_of_different_block_sizes():
    a = GenerationStats(block_size=4, prompt_tokens=5, generation_tokens=10, prompt_s=0.5, generation_s=1.0,
                        peak_memory_gb=1.0)
    a.record_step(3)
    a.phase_s["decode"] = 0.2
    b = GenerationStats(block_size=8, prompt_tokens=2, generation_tokens=6, prompt_s=0.1, generation_s=0.5,
                        peak_memory_gb=0.5)
    b.record_step(7)
    b.record_step(0)
    b.phase_s["decode"] = 0.3
    total = pooled([a, b], block_size=8)
    a.add(b)
    for s in (a, total):
        assert s.histogram == {4: 1, 8: 1, 1: 1} and s.steps == 3
        assert (s.accepted, s.drafted) == (10, 3 + 7 + 7)
        assert (s.prompt_tokens, s.generation_tokens) == (7, 16)
        assert s.prompt_s == pytest.approx(0.6) and s.generation_s == pytest.approx(1.5)
        assert s.phase_s["decode"] == pytest.approx(0.5) and s.peak_memory_gb == 1.0


def test_teacher_forced_acceptance():
    from dflash_mlx.stats import teacher_forced

    right = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
    out = teacher_forced(right)
    assert out["accuracy"] == [0.75, 0.75, 0.75]
    assert out["acceptance"] == [0.75, 0.5, 0.25]  # drafts 1..k all right
    assert out["tau"] == pytest.approx(1 + (2 + 1 + 0 + 3) / 4) and out["blocks"] == 4
    assert teacher_forced(np.zeros((0, 3), dtype=bool))["tau"] == 1.0
