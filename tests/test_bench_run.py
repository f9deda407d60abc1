"""Bench runs end to end: tiny random pairs in process, stories260K through the CLI."""

import json
import os

import pytest

from dflash_mlx import InputError
from dflash_mlx.bench.datasets import Sample
from dflash_mlx.bench.engines import DFlashEngine, MlxLmEngine
from dflash_mlx.bench.report import build_report, summarize
from dflash_mlx.bench.runner import BenchConfig, Runner, greedy_continuation, parse_baseline, timed_run
from dflash_mlx.bench.simulate import SimulatedDrafter
from mlx_lm.sample_utils import make_sampler

from conftest import dflash, mlx_lm_greedy, needs_shared, tiny_drafter, tiny_target

PROMPTS = [[5, 9, 23, 7, 100, 3], [17, 4, 4, 200, 31, 8, 60, 2, 11]]


@pytest.fixture(scope="module")
def pair():
    model, target = tiny_target("llama", layers=4)
    return model, target, tiny_drafter(target, block_size=8)


def samples():
    return [Sample(f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)]


class CountingDrafter:
    """Wraps a drafter and counts real forward passes."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, 0
        self.block_size, self.target_layer_ids = drafter.block_size, drafter.target_layer_ids

    def make_cache(self):
        return self.drafter.make_cache()

    def ingest(self, context, cache):
        self.drafter.ingest(context, cache)

    def draft(self, token, context, cache, block_size):
        self.calls += 1
        return self.drafter.draft(token, context, cache, block_size)


@pytest.mark.parametrize("accept, B", [(0, 4), (2, 4), (3, 4), (5, 8), (9, 8)])
def test_simulated_acceptance_gives_exact_tau_and_runs_the_real_drafter(pair, accept, B):
    _, target, drafter = pair
    ids, n = PROMPTS[1], 40
    sequence = greedy_continuation(target, ids, n + B, ())
    counting = CountingDrafter(drafter)
    sim = SimulatedDrafter(counting, sequence, accept, target.vocab_size)
    run = timed_run(DFlashEngine(target, sim, B), ids, n, make_sampler(0.0), ())
    assert run.tokens == sequence[len(ids): len(ids) + n]  # lossless
    a = min(accept, B - 1)
    assert run.stats.histogram == {a + 1: run.stats.steps}  # every verify accepted exactly A (capped at B-1)
    assert run.stats.tau == a + 1
    assert counting.calls == run.stats.steps  # the real forward ran for every verified block


def test_a_replayed_trace_accepts_its_lengths_block_by_block(pair):
    _, target, drafter = pair
    ids, n, B, trace = PROMPTS[1], 40, 8, [0, 3, 7, 1, 5]
    sequence = greedy_continuation(target, ids, n + B, ())
    sim = SimulatedDrafter(drafter, sequence, trace, target.vocab_size)
    run = timed_run(DFlashEngine(target, sim, B), ids, n, make_sampler(0.0), ())
    assert run.tokens == sequence[len(ids): len(ids) + n]  # lossless
    got = [a for a, _ in run.stats.trace]
    want = [trace[k % len(trace)] for k in range(run.stats.steps)]
    assert got[:-1] == want[:-1]  # the last block may be cut by max tokens
    assert run.stats.to_dict()["acceptance_trace"] == run.stats.trace
    assert all(d == B - 1 for _, d in run.stats.trace)


def test_read_trace_takes_generate_json_and_names_bad_files(tmp_path):
    from dflash_mlx.bench.simulate import read_trace

    one = tmp_path / "one.json"
    one.write_text(json.dumps({"tau": 2.0, "acceptance_trace": [[1, 15], [4, 15]]}, indent=2))
    assert read_trace(one) == [1, 4]
    lines = tmp_path / "runs.jsonl"
    lines.write_text(json.dumps({"acceptance_trace": [[2, 7]]}) + "\n" + json.dumps({"acceptance_trace": [[0, 7]]}) + "\n")
    assert read_trace(lines) == [2, 0]
    plain = tmp_path / "list.json"
    plain.write_text("[3, 0, 5]")
    assert read_trace(plain) == [3, 0, 5]
    for name, text, needle in [("empty.json", "[]", "empty"), ("neg.json", "[1, -2]", "not a count"),
                               ("nokey.json", '{"tau": 1}', "no acceptance_trace"), ("bad.json", "{x", "not JSON")]:
        bad = tmp_path / name
        bad.write_text(text)
        with pytest.raises(InputError, match=f"--simulate-acceptance .*{name}.*{needle}"):
            read_trace(bad)
    with pytest.raises(InputError, match="missing.json"):
        read_trace(tmp_path / "missing.json")


def test_simulated_proposals_are_right_then_wrong():
    sim = SimulatedDrafter(None, [10, 11, 12, 13, 14, 15], accept=2, vocab_size=16)
    assert sim.proposals(1, 6) == [12, 13, (14 + 1) % 16, (15 + 1) % 16, 0]  # past the end: filler
    with pytest.raises(ValueError):
        SimulatedDrafter(None, [], accept=-1, vocab_size=4)


def test_runner_alternates_engines_and_reports(pair):
    model, target, drafter = pair
    config = BenchConfig(max_tokens=24, block_sizes=[4, 8], repeats=2, simulate_acceptance=2, warmup_tokens=8)
    seen = []
    runner = Runner(target, drafter, DFlashEngine(target, None), config, stop_ids=())
    result = runner.run_dataset("tiny", samples(), progress=lambda name, done, total: seen.append((name, done, total)))
    assert seen == [("tiny", i, 4) for i in range(1, 5)]
    assert len(result.runs) == 2 * 2 * 3  # samples x repeats x (baseline + 2 block sizes)
    s = summarize(result)
    assert s["baseline"]["engine"] == "ar" and s["baseline"]["runs"] == 4
    assert [d["block_size"] for d in s["dflash"]] == [4, 8]
    for d in s["dflash"]:
        assert d["tau"] == pytest.approx(3.0)
        assert d["outputs_compared"] == 4 and d["outputs_differing"] == 0
        assert d["speedup_median_of_ratios"] > 0 and d["ideal_speedup"] > 0
        assert 0 < d["measured_over_ideal"] <= 1.0 + 1e-9
    report = build_report([result], {}, ["test"])
    json.dumps(report)  # serialisable


def test_mlx_lm_baselines_match_greedy(pair):
    model, target, drafter = pair
    small, _ = tiny_target("llama", layers=1, seed=3)
    ids, n = PROMPTS[0], 20
    want = mlx_lm_greedy(model, ids, n)
    sampler = make_sampler(0.0)
    plain = timed_run(MlxLmEngine(model), ids, n, sampler, ())
    assert plain.tokens == want and plain.decode_tokens == n - 1
    spec = timed_run(MlxLmEngine(model, small, num_draft_tokens=3), ids, n, sampler, ())
    assert spec.tokens == want
    assert max(spec.stats.histogram) <= 4 and spec.stats.steps == sum(spec.stats.histogram.values())
    assert spec.stats.tau >= 1 and spec.stats.drafted == 3 * spec.stats.steps
    dflash = timed_run(DFlashEngine(target, drafter, 4), ids, n, sampler, ())
    assert dflash.tokens == want


def test_stop_token_ends_runs_the_same_way(pair):
    model, target, drafter = pair
    ids = PROMPTS[0]
    free = mlx_lm_greedy(model, ids, 12)
    stop = free[5]
    expected = free[: free.index(stop)]
    sampler = make_sampler(0.0)
    for engine in (MlxLmEngine(model), DFlashEngine(target, None), DFlashEngine(target, drafter, 4)):
        assert timed_run(engine, ids, 12, sampler, (stop,)).tokens == expected, engine.name


def test_config_and_baseline_errors(pair):
    _, target, drafter = pair
    with pytest.raises(InputError, match="--simulate-acceptance needs --temp 0"):
        BenchConfig(temp=0.7, simulate_acceptance=3).check()
    with pytest.raises(InputError, match="--repeats"):
        BenchConfig(repeats=0).check()
    with pytest.raises(InputError, match="--block-size 9"):
        Runner(target, drafter, DFlashEngine(target, None), BenchConfig(block_sizes=[9]))
    assert parse_baseline("draft-model:/x/y") == ("draft-model", "/x/y")
    with pytest.raises(InputError, match="--baseline"):
        parse_baseline("eagle")


# --------------------------------------------------------------------------- CLI, stories260K


def dflash_bench(*args, timeout=120):
    return dflash("bench", *args, text=True, timeout=timeout, env={**os.environ, "COLUMNS": "160"})


@needs_shared
def test_cli_bench_end_to_end(stories, random_drafter, tmp_path):
    prompts = tmp_path / "stories.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Once upon a time", "Tom had a red ball.", "The cat sat"]))
    out = tmp_path / "out"
    r = dflash_bench("--model", str(stories), "--draft-model", str(random_drafter), "--dataset", str(prompts),
                     "-n", "2", "-m", "24", "--block-size", "4", "8", "--warmup-tokens", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "dflash B=4" in r.stdout and "dflash B=8" in r.stdout and "measured" in r.stdout
    report = json.loads((out / "results.json").read_text())
    assert report["command"][:2] == ["dflash", "bench"] and "--block-size" in report["command"]
    assert report["config"]["block_sizes"] == [4, 8] and report["config"]["max_tokens"] == 24
    ds = report["datasets"][0]
    assert ds["name"] == "stories" and ds["num_samples"] == 2 and len(ds["runs"]) == 2 * 3
    for d in ds["dflash"]:
        assert d["outputs_differing"] == 0  # float32 target: exactly the baseline's tokens
        assert d["decode_tps_median"] > 0 and d["steps"] > 0
    for name in ("speedup.png", "acceptance_histogram.png", "tokens_per_s.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    # The folder now holds a run: refused before any work, in one line.
    again = ["--model", str(stories), "--draft-model", str(random_drafter), "--dataset", str(prompts), "-n", "1",
             "-m", "8", "--warmup-tokens", "0", "--no-plots", "--top-k", "100000", "--temp", "0.5", "--out", str(out)]
    r = dflash_bench(*again)
    assert r.returncode == 1 and r.stderr == (f"error: --out {out}: the folder is not empty (an earlier run?); "
                                              "pass --overwrite to replace its results, or a new --out\n")
    assert json.loads((out / "results.json").read_text())["config"]["max_tokens"] == 24  # untouched
    # --overwrite replaces the run, and removes the plots this run did not redraw;
    # a top-k past the vocabulary (512) is no top-k.
    (out / "notes.txt").write_text("mine")
    r = dflash_bench(*again, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json"]
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["max_tokens"] == 8 and config["top_k"] == 0


def test_cli_bench_out_is_checked_before_the_work(tmp_path):
    """No model is loaded (the paths do not even exist): the folder is checked first."""
    afile = tmp_path / "results"
    afile.write_text("")
    r = dflash_bench("--model", "nope", "--draft-model", "nope", "--out", str(afile))
    assert r.returncode == 1
    assert r.stderr == f"error: --out {afile}: is a file; give a folder for results.json and the plots\n"


@needs_shared
@pytest.mark.parametrize("args, needle", [
    (["--block-size", "4", "x"], "--block-size must be an integer or 'auto', got 'x'"),
    (["stray"], "unexpected argument"),
    (["--simulate-acceptance", "2", "--temp", "0.5"], "needs --temp 0"),
    (["--simulate-acceptance", "no-such-trace.json"], "--simulate-acceptance no-such-trace.json"),
    (["--baseline", "eagle"], "--baseline eagle"),
])
def test_cli_bad_flags(stories, random_drafter, tmp_path, args, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once"}\n')
    r = dflash_bench("--model", str(stories), "--draft-model", str(random_drafter), "--dataset", str(prompts),
                     "--no-plots", "--out", str(tmp_path / "o"), *args)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr


@needs_shared
def test_multi_turn_sample_carries_the_answer_into_the_next_turn(stories, random_drafter):
    from dflash_mlx import load

    pair = load(str(stories), str(random_drafter))
    config = BenchConfig(max_tokens=12, block_sizes=[4], warmup_tokens=4)
    runner = Runner(pair.target, pair.drafter, DFlashEngine(pair.target, None), config, tokenizer=pair.tokenizer)
    result = runner.run_dataset("mt", [Sample("q1", turns=["Once upon a time", "The next day"])])
    first, second = ([r for r in result.runs if r.turn == t] for t in (0, 1))
    assert len(first) == len(second) == 2
    # turn 2's prompt is turn 1 + the answer + turn 2 (no chat template: joined by newlines)
    answer = pair.tokenizer.decode(first[0].tokens)
    want = pair.tokenizer.encode("\n".join(["Once upon a time", answer, "The next day"]))
    assert second[0].prompt_tokens == len(want) > first[0].prompt_tokens
    assert all(r.matches_baseline for r in result.runs if r.engine == "dflash")


def test_auto_and_tree_rows_are_lossless_and_labelled(pair, tmp_path):
    # dflash bench --block-size 4 auto --tree-budget 8 auto: one row each, outputs equal the baseline's.
    model, target, drafter = pair
    config = BenchConfig(max_tokens=24, block_sizes=[4, "auto"], tree_budgets=[8, "auto"], warmup_tokens=8)
    runner = Runner(target, drafter, DFlashEngine(target, None), config, stop_ids=())
    s = summarize(runner.run_dataset("tiny", samples()))
    assert [d["block_size"] for d in s["dflash"]] == [4, "auto", "tree 8", "auto+tree"]
    assert all(d["outputs_differing"] == 0 for d in s["dflash"])
    report = build_report([runner.run_dataset("tiny", samples())], {}, ["test"])
    from dflash_mlx.bench.plots import write_plots

    assert write_plots(report, tmp_path)  # labels that are not numbers plot too
    from rich.console import Console

    from dflash_mlx.cli.bench_tables import results_table

    console = Console(width=200, record=True)
    console.print(results_table(report))
    assert "dflash tree 8" in console.export_text()


def test_list_flags_take_the_values_click_leaves_over():
    from dflash_mlx.cli.bench import parse_block_sizes, split_extra

    argv = ["dflash", "bench", "--block-size", "4", "8", "--tree-budget", "16", "32", "auto"]
    assert split_extra(["4"], ["16"], ["8", "32", "auto"], argv) == (["8"], ["32", "auto"])
    assert split_extra(["4"], ["16"], ["8", "32"], ["x"]) == ([], ["8", "32"])  # no command line: the last flag
    assert split_extra(None, ["16"], ["32"]) == ([], ["32"])
    assert parse_block_sizes(["4", "auto"], ["8,16"]) == [4, "auto", 8, 16]
    with pytest.raises(InputError, match="--tree-budget must be a node count >= 1 or 'auto', got 'x'"):
        parse_block_sizes(["x"], [], "--tree-budget")
