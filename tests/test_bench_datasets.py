"""Bench prompt sets: the shared files (row counts, prompt fields), user JSONL, errors."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from dflash_mlx import InputError
from dflash_mlx.bench.datasets import (
    HUMANEVAL_PREFIX, MATH_SUFFIX, detect_format, encode_sample_turn, load_dataset, load_file,
)
from conftest import SHARED

DATASETS = SHARED / "datasets"
needs_datasets = pytest.mark.skipif(
    not (DATASETS / "gsm8k_test.jsonl").is_file(),
    reason=f"needs ../shared/datasets (not found at {DATASETS}); CI always has it",
)


@needs_datasets
@pytest.mark.parametrize("file, fmt, rows, turns", [
    ("gsm8k_test.jsonl", "gsm8k", 1319, 1),
    ("math500_test.jsonl", "math500", 500, 1),
    ("humaneval.jsonl.gz", "humaneval", 164, 1),
    ("mbpp_sanitized_test.jsonl", "mbpp", 257, 1),
    ("mt_bench_questions.jsonl", "mt-bench", 80, 2),
])
def test_shared_files_detected_by_fields(file, fmt, rows, turns):
    name, samples = load_file(DATASETS / file)
    assert name == fmt
    assert len(samples) == rows
    assert all(len(s.turns) == turns and all(t.strip() for t in s.turns) for s in samples)
    assert len({s.id for s in samples}) == rows  # ids are unique


@needs_datasets
def test_shared_prompt_wording():
    _, gsm = load_file(DATASETS / "gsm8k_test.jsonl", num_samples=3)
    assert len(gsm) == 3
    assert gsm[0].turns[0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert gsm[0].turns[0].endswith(MATH_SUFFIX) and "#### 18" not in gsm[0].turns[0]  # no answer leak
    _, math = load_file(DATASETS / "math500_test.jsonl", num_samples=1)
    assert math[0].turns[0].startswith("Convert the point $(0,3)$") and math[0].turns[0].endswith(MATH_SUFFIX)
    _, he = load_file(DATASETS / "humaneval.jsonl.gz", num_samples=1)
    assert he[0].id == "HumanEval/0"
    assert he[0].turns[0].startswith(HUMANEVAL_PREFIX + "from typing import List") and he[0].turns[0].endswith("```")
    _, mbpp = load_file(DATASETS / "mbpp_sanitized_test.jsonl", num_samples=1)
    assert mbpp[0].turns == [
        "Write a python function to remove first and last occurrence of a given character from the string."
    ]
    _, mt = load_file(DATASETS / "mt_bench_questions.jsonl", num_samples=1)
    assert mt[0].id == "81" and mt[0].turns[1].startswith("Rewrite your previous response.")


@needs_datasets
def test_load_dataset_takes_a_path_and_names_it():
    name, samples = load_dataset(str(DATASETS / "humaneval.jsonl.gz"), num_samples=5)
    assert name == "humaneval" and len(samples) == 5


def test_user_jsonl_prompt_and_messages(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        json.dumps({"prompt": "Tell me a story."}) + "\n\n"
        + json.dumps({"prompt": "Another one."}) + "\n"
    )
    name, samples = load_dataset(str(f))
    assert name == "mine" and [s.turns for s in samples] == [["Tell me a story."], ["Another one."]]

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    g = tmp_path / "chats.jsonl.gz"
    with gzip.open(g, "wt") as fh:
        fh.write(json.dumps({"messages": chat}) + "\n")
    fmt, samples = load_file(g)
    assert fmt == "messages"
    assert samples[0].messages == chat[:2] and samples[0].turns == []  # the given answer is dropped

    j = tmp_path / "list.json"
    j.write_text(json.dumps([{"instruction": "Sum 2 and 3.", "input": "", "output": "5"}]))
    fmt, samples = load_file(j)
    assert fmt == "alpaca" and samples[0].turns == ["Sum 2 and 3."]


@pytest.mark.parametrize("content, needle", [
    ('{"text": "no known field"}\n', "unknown row format"),
    ('{"prompt": "ok"}\nnot json\n', ":2: not JSON"),
    ('{"messages": "not a list"}\n', "'messages' must be"),
    ('{"prompt": "   "}\n', "empty prompt"),
    ("", "has no rows"),
])
def test_bad_files_name_the_problem(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(InputError, match=needle):
        load_dataset(str(f))


def test_unknown_name_and_bad_count():
    with pytest.raises(InputError, match="neither a file nor a known name"):
        load_dataset("no-such-set")
    with pytest.raises(InputError, match="--num-samples"):
        load_dataset("gsm8k", num_samples=0)


def test_detect_format_prefers_specific_formats():
    assert detect_format({"prompt": "p", "code": "c", "test_list": []}).name == "mbpp"
    assert detect_format({"task_id": "t", "prompt": "p", "entry_point": "f"}).name == "humaneval"
    assert detect_format({"prompt": "p"}).name == "prompt"


def test_hub_name_offline_says_how_to_pass_a_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError) as e:
        load_dataset("gsm8k")
    msg = str(e.value)
    assert "openai/gsm8k" in msg and "offline" in msg
    assert "--dataset PATH" in msg and "gsm8k_test.jsonl" in msg


@needs_datasets
@pytest.mark.parametrize("name, file", [("gsm8k", "gsm8k_test.jsonl"), ("math500", "math500_test.jsonl"),
                                        ("humaneval", "humaneval.jsonl.gz"), ("mbpp", "mbpp_sanitized_test.jsonl"),
                                        ("mt-bench", "mt_bench_questions.jsonl")])
def test_the_first_80_rows_of_each_set_ship_and_need_no_hub(name, file, monkeypatch):
    """Up to 80 rows of a built-in set are read from the rows shipped in the package (offline, without
    `datasets`): the same samples as ../shared's copy of the set; more go to the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "datasets", None)
    got, samples = load_dataset(name, 80)
    assert got == name and samples == load_file(DATASETS / file, 80)[1]
    with pytest.raises(InputError, match="offline"):
        load_dataset(name, 81)


def test_cli_offline_dataset_error_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli.main", "bench", "--model", str(tmp_path / "m"),
         "--draft-model", str(tmp_path / "d"), "--dataset", "math500", "-n", "0"],  # all 500: from the hub
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "HuggingFaceH4/MATH-500" in r.stderr and "--dataset PATH" in r.stderr


class _Tok:
    """Minimal stand-in for an mlx-lm TokenizerWrapper."""

    def __init__(self, template: bool):
        self.has_chat_template = template
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(kwargs)
        return "|".join(m["content"] for m in messages) + "|assistant:"

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_encoding_uses_the_chat_template_with_thinking_off_by_default():
    tok = _Tok(template=True)
    ids = encode_sample_turn(tok, [{"role": "user", "content": "hi"}])
    assert ids == [ord(c) for c in "hi|assistant:"]  # no BOS added twice
    assert tok.calls[-1]["enable_thinking"] is False and tok.calls[-1]["add_generation_prompt"] is True
    encode_sample_turn(tok, [{"role": "user", "content": "hi"}], enable_thinking=True)
    assert tok.calls[-1]["enable_thinking"] is True
    plain = _Tok(template=False)
    assert encode_sample_turn(plain, [{"role": "user", "content": "ab"}]) == [1, ord("a"), ord("b")]


def test_hub_name_without_datasets_package(monkeypatch):
    import importlib.util

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(InputError, match="pip install datasets.*--dataset PATH"):
        load_dataset("mbpp")


def test_hub_name_goes_through_datasets_with_the_authors_ids(monkeypatch):
    """With a stand-in ``datasets`` module: the repo/config/split asked for, and the rows'
    format (MT-Bench on the hub has a 'prompt' list, not 'turns')."""
    import types

    calls = []

    def fake_load_dataset(*args, split):
        calls.append((args, split))
        return [{"prompt": ["first turn", "second turn"], "category": "writing", "prompt_id": 1}] * 3

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    name, samples = load_dataset("mt-bench", num_samples=None)  # all rows: from the hub, not the 80 shipped
    assert calls == [(("HuggingFaceH4/mt_bench_prompts",), "train")]
    assert name == "mt-bench" and len(samples) == 3 and samples[0].turns == ["first turn", "second turn"]
