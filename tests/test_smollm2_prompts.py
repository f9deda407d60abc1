"""scripts/smollm2/prompts.py with GSM8K's train split and GPTeacher's instruction sets: their prompts are written
beside the other prompt files, worded as `dflash bench` words such rows, and a file holding a question of GSM8K's
test split (the held-out rows among them), a turn of MT-Bench or a HumanEval task is refused, so evaluation prompts
never become training prompts."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/smollm2/prompts.py"
TEST_SPLIT = SHARED / "datasets/gsm8k_test.jsonl"

pytestmark = pytest.mark.skipif(not TEST_SPLIT.exists(), reason=f"needs {TEST_SPLIT}; CI always has it")


def _run(tmp_path, rows, flag="--gsm8k-train", name="train.jsonl"):
    split = tmp_path / name
    split.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run([sys.executable, str(SCRIPT), "--shared", str(SHARED), "--out", str(tmp_path / "out"),
                           flag, str(split)], capture_output=True, text=True)


def test_train_split_questions_are_worded_as_the_held_out_ones(tmp_path):
    rows = [{"question": "Ann has 3 apples and buys 4 more. How many apples does she have?", "answer": "#### 7"}]
    done = _run(tmp_path, rows)
    assert done.returncode == 0, done.stderr
    written = [json.loads(line)["prompt"] for line in (tmp_path / "out/gsm8k_train.jsonl").read_text().splitlines()]
    held_out = json.loads((tmp_path / "out/gsm8k_heldout.jsonl").read_text().splitlines()[0])["prompt"]
    instruction = held_out.rsplit("\n", 1)[1]  # what follows the question (hand-checked: the step-by-step ask)
    assert written == [rows[0]["question"] + "\n" + instruction]


def test_a_split_holding_a_held_out_question_is_refused(tmp_path):
    held_out = json.loads(TEST_SPLIT.read_text().splitlines()[1200])
    done = _run(tmp_path, [{"question": "A new question?", "answer": "#### 1"}, held_out])
    assert done.returncode != 0
    assert "test split" in done.stderr and str(tmp_path / "train.jsonl") in done.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_roleplay_rows_are_an_instruction_then_its_input(tmp_path):
    rows = [{"instruction": "You are a pirate captain. Greet your crew.", "input": "The crew boards at dawn.",
             "response": "Ahoy!"},
            {"instruction": "Pretend you are a lighthouse keeper.", "input": "", "response": "."}]
    done = _run(tmp_path, rows, "--gpteacher", "roleplay-simple-deduped-roleplay-instruct.json")
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out/gpteacher_roleplay.jsonl").read_text().splitlines()
    written = [json.loads(line)["prompt"] for line in lines]
    assert written == ["You are a pirate captain. Greet your crew.\n\nThe crew boards at dawn.",
                       "Pretend you are a lighthouse keeper."]


@pytest.mark.parametrize("held_out", ["mt-bench", "humaneval"])
def test_an_instruction_set_holding_a_held_out_turn_or_task_is_refused(tmp_path, held_out):
    if held_out == "mt-bench":
        text = json.loads((SHARED / "datasets/mt_bench_questions.jsonl").read_text().splitlines()[5])["turns"][1]
    else:
        with gzip.open(SHARED / "datasets/humaneval.jsonl.gz", "rt") as f:
            text = json.loads(f.readlines()[7])["prompt"]
    done = _run(tmp_path, [{"instruction": "Play a part.", "input": text, "response": "."}], "--gpteacher")
    assert done.returncode != 0
    assert "MT-Bench" in done.stderr and str(tmp_path / "train.jsonl") in done.stderr
    assert not (tmp_path / "out").exists()  # nothing written
