"""Bench statistics on synthetic timings: medians, ratios, the ideal speedup, JSON, plots."""

import json

import pytest

from dflash_mlx.bench.report import (
    SCHEMA, build_report, cycle_ms, ideal_speedup, median, ratio, summarize, tokens_per_step, write_report,
)
from dflash_mlx.cli.bench_tables import cycle_table, histogram_lines, results_table
from dflash_mlx.bench.runner import DatasetResult, RunRecord
from dflash_mlx.stats import GenerationStats


def stats_of(block_size, lengths, phases=None):
    """GenerationStats with ``lengths[k]`` verify steps of acceptance length k."""
    st = GenerationStats(block_size=block_size)
    for k, n in lengths.items():
        for _ in range(n):
            st.record_step(k - 1)
    st.phase_s.update(phases or {})
    return st


def base_run(sample, decode_s, tokens=101, repeat=0):
    """A plain run: 1 first token then ``tokens - 1`` decode tokens in ``decode_s`` seconds."""
    return RunRecord(sample=sample, turn=0, repeat=repeat, engine="ar", block_size=1, prompt_tokens=10,
                     tokens=list(range(tokens)), first_tokens=1, prompt_s=0.01, decode_s=decode_s,
                     stats=stats_of(1, {1: tokens - 1}), peak_memory_gb=1.0)


def dflash_run(sample, decode_s, lengths, step_s, block_size=4, matches=True, tokens=None):
    tokens = tokens if tokens is not None else 1 + sum(k * n for k, n in lengths.items())
    stats = stats_of(block_size, lengths, {"prefill": 0.01, "decode": step_s})
    return RunRecord(sample=sample, turn=0, repeat=0, engine="dflash", block_size=block_size, prompt_tokens=10,
                     tokens=list(range(tokens)), first_tokens=1, prompt_s=0.02, decode_s=decode_s, stats=stats,
                     peak_memory_gb=1.5, matches_baseline=matches)


def synthetic():
    """Three samples; baseline 100 tokens at 1.0/1.2/0.8 s. DFlash B=4 with 25 steps
    accepting 3 (tau 4, 100 decode tokens) in 0.5/0.4/0.5 s."""
    runs = []
    for sample, b, d in [("a", 1.0, 0.5), ("b", 1.2, 0.4), ("c", 0.8, 0.5)]:
        runs.append(base_run(sample, b))
        # the 25 steps take 0.4 s
        runs.append(dflash_run(sample, d, {4: 25}, 0.4, matches=sample != "c"))
    return DatasetResult("synthetic", 3, "ar", runs)


def test_median_and_ratio_helpers():
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None]) is None
    assert median([1.0, 4.0]) == 2.5
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(1.0, 0.0) is None


def test_run_rates():
    r = base_run("a", 2.0)
    assert r.decode_tokens == 100 and r.decode_tps == pytest.approx(50.0)
    assert r.prompt_tps == pytest.approx(1000.0)
    assert RunRecord("x", 0, 0, "ar", 1, 5, tokens=[7], first_tokens=1).decode_tps is None  # nothing decoded


def test_speedups_medians_and_ideal():
    s = summarize(synthetic())
    base, d = s["baseline"], s["dflash"][0]
    assert base["decode_tps_median"] == pytest.approx(100.0)  # 100/1.0, 100/1.2, 100/0.8
    assert d["decode_tps_median"] == pytest.approx(200.0)  # 100/0.5, 100/0.4, 100/0.5
    assert d["speedup_ratio_of_medians"] == pytest.approx(2.0)
    # per pair: 200/100 = 2.0, 250/83.3 = 3.0, 200/125 = 1.6 -> median 2.0
    assert d["speedup_median_of_ratios"] == pytest.approx(2.0)
    assert d["tau"] == pytest.approx(4.0) and d["tokens_per_step"] == pytest.approx(4.0)
    assert d["acceptance_rate"] == pytest.approx(1.0)
    assert d["acceptance_histogram"] == {"4": 75}
    # ideal per pair: 4 x t_AR / ((0.1 + 0.3) / 25 s) = t_AR x 250
    # t_AR = 0.010, 0.012, 0.008 -> ideal 2.5, 3.0, 2.0 -> median 2.5
    assert d["ideal_speedup"] == pytest.approx(2.5)
    # measured/ideal = steps / decode_s = 0.4/0.5, 0.4/0.4, 0.4/0.5 -> median 0.8
    assert d["measured_over_ideal"] == pytest.approx(0.8)
    assert d["cycle_ms"]["decode"] == pytest.approx(16.0)  # 0.4 s / 25 steps
    assert d["cycle_ms"]["other"] == pytest.approx(4.0)  # (0.5 - 0.4) s / 25, the median of 4, 0, 4
    assert d["outputs_compared"] == 3 and d["outputs_differing"] == 1


def test_cycle_breakdown_and_tokens_per_step():
    r = dflash_run("a", 1.0, {1: 10, 4: 10}, step_s=0.9)
    c = cycle_ms(r)  # 20 steps
    assert c == pytest.approx({"decode": 45.0, "other": 5.0})
    # a last block cut at max tokens: 10 steps of tau 4 but only 31 decode tokens
    cut = dflash_run("a", 1.0, {4: 10}, 0.6, tokens=32)
    assert cut.stats.tau == 4.0 and tokens_per_step(cut) == pytest.approx(3.1)
    base = base_run("a", 1.0)  # 10 ms/token
    assert ideal_speedup(cut, base) == pytest.approx(3.1 * 0.01 / 0.06)
    assert ideal_speedup(cut, base, tau=cut.stats.tau) == pytest.approx(4 * 0.01 / 0.06)


def test_report_schema_and_json_round_trip(tmp_path):
    report = build_report([synthetic()], {"max_tokens": 100}, ["dflash", "bench", "--dataset", "x"])
    path = write_report(report, tmp_path / "out")
    loaded = json.loads(path.read_text())
    assert loaded["schema"] == SCHEMA
    assert loaded["command"] == ["dflash", "bench", "--dataset", "x"]
    assert {"created", "config", "machine", "datasets"} <= set(loaded)
    assert {"mlx", "mlx_lm", "platform", "load_average"} <= set(loaded["machine"])
    ds = loaded["datasets"][0]
    assert set(ds) == {"name", "num_samples", "baseline", "dflash", "runs"}
    assert {"decode_tps_median", "prompt_tps_median", "peak_memory_gb_max", "s_per_token_median"} <= set(ds["baseline"])
    d = ds["dflash"][0]
    for key in ("block_size", "tau", "acceptance_rate", "acceptance_histogram", "decode_tps_median",
                "prompt_tps_median", "peak_memory_gb_max", "speedup_ratio_of_medians", "speedup_median_of_ratios",
                "ideal_speedup", "measured_over_ideal", "cycle_ms", "outputs_differing"):
        assert key in d, key
    assert set(d["cycle_ms"]) == {"decode", "other"}
    assert len(ds["runs"]) == 6 and "tokens" not in ds["runs"][0]
    assert {"decode_tps", "prompt_tps", "phase_s", "peak_memory_gb", "matches_baseline"} <= set(ds["runs"][1])


def test_tables_and_histogram_lines_render():
    from rich.console import Console

    report = build_report([synthetic()], {}, [])
    console = Console(width=120, record=True)
    console.print(results_table(report))
    console.print(cycle_table(report))
    text = console.export_text()
    assert "dflash B=4" in text and "2.00x" in text and "1/3" in text and "0.800" in text
    assert histogram_lines(report) == ["synthetic B=4: acceptance length 4:100%"]


def test_a_speedup_not_measured_is_a_dash_in_both_tables():
    from rich.console import Console

    report = build_report([synthetic()], {}, [])
    for key in ("speedup_ratio_of_medians", "speedup_median_of_ratios", "ideal_speedup"):
        report["datasets"][0]["dflash"][0][key] = None
    console = Console(width=160, record=True)
    console.print(results_table(report))
    console.print(cycle_table(report))
    text = console.export_text()
    assert "-x" not in text and "2.00x" not in text and "1.00x" in text  # the baseline's own row stays


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from dflash_mlx.bench.plots import write_plots

    second = synthetic()
    second.name = "other"
    files = write_plots(build_report([synthetic(), second], {}, []), tmp_path)
    assert set(files) == {"speedup", "acceptance_histogram", "tokens_per_s"}
    for path in files.values():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
