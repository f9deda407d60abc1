"""GenerationStats: tau, histogram, rates and the printed lines."""

import pytest

from dflash_mlx import GenerationStats
from dflash_mlx.generate import count_accepted


def test_tau_and_histogram():
    s = GenerationStats(block_size=4)
    for a in (3, 0, 1, 3):
        s.record_step(a)
    assert s.histogram == [1, 1, 0, 2]
    assert s.tau == pytest.approx((4 + 1 + 2 + 4) / 4)
    assert s.acceptance_rate == pytest.approx(7 / 12)


def test_rates_and_lines():
    s = GenerationStats(block_size=4, prompt_tokens=10, generation_tokens=50, prompt_s=0.5, generation_s=2.0)
    s.record_step(2)
    s.phase_s["verify"] = 0.25
    assert s.prompt_tps == 20 and s.generation_tps == 25
    lines = s.format_lines()
    assert lines[0] == "Prompt: 10 tokens, 20.000 tokens-per-sec"
    assert lines[1] == "Generation: 50 tokens, 25.000 tokens-per-sec"
    assert lines[2].startswith("Peak memory: ")
    assert lines[3].startswith("Acceptance: tau 3.00") and lines[4] == "Histogram: 2:1"
    assert s.to_dict()["timings_ms"]["verify"] == 250.0


def test_plain_stats_have_no_acceptance_line():
    assert not any(line.startswith("Acceptance") for line in GenerationStats(block_size=1).format_lines())


@pytest.mark.parametrize("drafts, targets, a", [
    ([5, 6, 7], [5, 6, 7, 8], 3), ([5, 6, 7], [5, 9, 7, 8], 1), ([5, 6, 7], [1, 6, 7, 8], 0),
])
def test_count_accepted(drafts, targets, a):
    assert count_accepted(drafts, targets) == a


def test_add_accumulates_generations_of_different_block_sizes():
    a = GenerationStats(block_size=4, prompt_tokens=5, generation_tokens=10, prompt_s=0.5, generation_s=1.0,
                        peak_memory_gb=1.0)
    a.record_step(3)
    a.phase_s["verify"] = 0.2
    b = GenerationStats(block_size=8, prompt_tokens=2, generation_tokens=6, prompt_s=0.1, generation_s=0.5,
                        peak_memory_gb=0.5)
    b.record_step(7)
    b.record_step(0)
    b.phase_s["verify"] = 0.3
    a.add(b)
    assert a.histogram == [1, 0, 0, 1, 0, 0, 0, 1] and a.steps == 3
    assert (a.prompt_tokens, a.generation_tokens) == (7, 16)
    assert a.prompt_s == pytest.approx(0.6) and a.generation_s == pytest.approx(1.5)
    assert a.phase_s["verify"] == pytest.approx(0.5) and a.peak_memory_gb == 1.0
