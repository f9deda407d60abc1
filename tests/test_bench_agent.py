"""`dflash bench --agent-trace`: replaying a trace with growing shared prefixes reuses
them from disk (a new cache per request) and live, with the cold run's text, and
mlx-lm's prompt cache reuses the same prefixes; bad trace files are one-line errors."""

import json
from types import SimpleNamespace

import pytest

from dflash_mlx import InputError
from dflash_mlx.bench.agent import read_agent_trace, run_trace, summarize
from conftest import ROOT, ByteTokenizer, dflash, needs_shared, tiny_drafter, tiny_target

BASE = [(3 * i) % 200 + 5 for i in range(30)]
PROMPTS = [BASE, BASE + [9, 8, 7, 6], BASE + [9, 8, 7, 6, 5, 4], BASE[:20] + [1, 2]]


def test_replay_reuses_growing_prefixes_with_the_cold_text():
    model, target = tiny_target("llama")
    pair = SimpleNamespace(model=model, target=target, drafter=tiny_drafter(target), tokenizer=ByteTokenizer())
    records = run_trace(pair, "t", PROMPTS, ("cold", "disk", "live"), 6, block_size=4, prefill_step_size=8)
    by = {(r.mode, r.index): r for r in records}
    assert all(r.same_as_cold for r in records)
    assert [by["cold", i].reused for i in range(4)] == [0, 0, 0, 0]
    for mode in ("disk", "live"):
        # Request 1 continues request 0's prompt: everything but its last token comes from the cache.
        assert by[mode, 1].reused >= len(BASE) - 1
        assert by[mode, 3].reused == 20  # a branch resumes at the longest common prefix
    rows = {r["mode"]: r for r in summarize(records)}
    assert rows["disk"]["reused"] == rows["live"]["reused"] > 0
    assert rows["disk"]["reused"] + rows["disk"]["prefilled"] == rows["cold"]["prompt_tokens"]


def test_bad_trace_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(InputError, match=r't.jsonl: row 2: needs a "prompt" string or a "messages" list'):
        read_agent_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(InputError, match=r"t.jsonl:1: not JSON"):
        read_agent_trace(bad)
    with pytest.raises(InputError, match="no such file|No such file"):
        read_agent_trace(tmp_path / "missing.jsonl")


def test_the_shipped_traces_share_growing_prefixes():
    for name in ("agent_mbpp", "agent_gsm8k"):
        prompts = read_agent_trace(ROOT / "benchmarks" / "traces" / f"{name}.jsonl")
        assert len(prompts) == 9
        assert all(b.startswith(a) for a, b in zip(prompts[:7], prompts[1:8]))  # each extends the one before
        assert not prompts[8].startswith(prompts[7][: len(prompts[8])])  # the last one branches off


@needs_shared
def test_bench_agent_trace_end_to_end(stories, random_drafter, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                             ("Once upon a time", "Once upon a time, there was a cat", "Once upon a time, there was a dog")))
    out = tmp_path / "out"
    r = dflash("bench", "--model", str(stories), "--draft-model", str(random_drafter), "--agent-trace", str(trace),
               "-m", "8", "--out", str(out), text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "results.json").read_text())
    rows = {row["mode"]: row for row in result["summary"] if row["trace"] == "trace"}
    assert set(rows) == {"cold", "disk", "live", "mlx-lm"}
    assert rows["cold"]["reused"] == 0 and rows["disk"]["reused"] > 0 and rows["disk"]["same_as_cold"]
