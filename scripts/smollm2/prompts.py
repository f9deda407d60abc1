#!/usr/bin/env python3
"""The SmolLM2 drafter's prompt files, from ../shared/datasets, worded as `dflash bench` asks them.

Training (the paper's recipe: the target regenerates the responses): GSM8K rows 0-999, MATH-500 and MBPP;
with ``--gsm8k-train``, also GSM8K's own train split (7,473 questions, none of them in its test split);
with ``--roleplay``, GPTeacher's role-play instructions (1,923, chat of MT-Bench's kind, none of its turns).
Evaluation, never trained on: GSM8K rows 1,000 on, HumanEval and MT-Bench first turns.

    python scripts/smollm2/prompts.py --shared ../shared --out OUT/prompts \
        [--gsm8k-train grade-school-math/grade_school_math/data/train.jsonl]
        [--roleplay GPTeacher/Roleplay/roleplay-simple-deduped-roleplay-instruct.json]
    -> OUT/prompts/{train,gsm8k_heldout,humaneval,mt_bench}.jsonl (rows of "prompt"), gsm8k_train.jsonl, roleplay.jsonl

The train split is not in ../shared: it is ``grade_school_math/data/train.jsonl`` of
github.com/openai/grade-school-math (MIT), worded as the test split's questions are. The role-play set is
``Roleplay/roleplay-simple-deduped-roleplay-instruct.json`` of github.com/teknium1/GPTeacher (MIT): each
instruction with its input after a blank line, as `dflash bench` words Alpaca's rows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from dflash_mlx.bench.datasets import FORMATS, load_file, read_rows  # noqa: E402
GSM8K_TRAIN_ROWS = 1000  # rows 0-999 train; rows from 1,000 on are held out


def rows_of(path: Path) -> list:
    return [s.turns[0] for s in load_file(path)[1]]


def instructions_of(path: Path) -> list:
    """GPTeacher's rows (instruction, input, response) worded as Alpaca's (instruction, input, output)."""
    alpaca = next(f for f in FORMATS if f.name == "alpaca")
    return [alpaca.turns(row)[0] for row in read_rows(path)]


def write(path: Path, prompts: list) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tmp.rename(path)
    print(f"{path}: {len(prompts)} prompts")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gsm8k-train", type=Path, help="GSM8K's train split (JSONL of question, answer)")
    p.add_argument("--roleplay", type=Path, help="GPTeacher's role-play set (JSON of instruction, input, response)")
    args = p.parse_args()
    data = args.shared / "datasets"
    gsm8k = rows_of(data / "gsm8k_test.jsonl")
    extra = rows_of(args.gsm8k_train) if args.gsm8k_train else []
    if set(extra) & set(gsm8k):  # checked before anything is written
        sys.exit(f"{args.gsm8k_train}: holds questions of GSM8K's test split; pass the train split")
    roleplay = instructions_of(args.roleplay) if args.roleplay else []
    mt_bench = [turn for sample in load_file(data / "mt_bench_questions.jsonl")[1] for turn in sample.turns]
    if any(turn in prompt for prompt in roleplay for turn in mt_bench):
        sys.exit(f"{args.roleplay}: holds a turn of MT-Bench, an evaluation set")
    args.out.mkdir(parents=True, exist_ok=True)
    train = gsm8k[:GSM8K_TRAIN_ROWS] + rows_of(data / "math500_test.jsonl") + rows_of(data / "mbpp_sanitized_test.jsonl")
    random.Random(0).shuffle(train)  # every shard holds each set: a run cut short is still balanced
    write(args.out / "train.jsonl", train)
    write(args.out / "gsm8k_heldout.jsonl", gsm8k[GSM8K_TRAIN_ROWS:])
    write(args.out / "humaneval.jsonl", rows_of(data / "humaneval.jsonl.gz"))
    write(args.out / "mt_bench.jsonl", rows_of(data / "mt_bench_questions.jsonl"))
    if args.gsm8k_train:
        write(args.out / "gsm8k_train.jsonl", extra)
    if args.roleplay:
        write(args.out / "roleplay.jsonl", roleplay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
