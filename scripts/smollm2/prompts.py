#!/usr/bin/env python3
"""The SmolLM2 drafter's prompt files, from ../shared/datasets, worded as `dflash bench` asks them.

Training (the paper's recipe: the target regenerates the responses): GSM8K rows 0-999, MATH-500 and MBPP;
with ``--gsm8k-train``, also GSM8K's own train split (7,473 questions, none of them in its test split);
with ``--gpteacher``, GPTeacher's instruction sets (role play: 1,923, chat of MT-Bench's kind; code: 4,535),
none holding a held-out question, task or turn.
Evaluation, never trained on: GSM8K rows 1,000 on, HumanEval and MT-Bench first turns.

    python scripts/smollm2/prompts.py --shared ../shared --out OUT/prompts \
        [--gsm8k-train grade-school-math/grade_school_math/data/train.jsonl]
        [--gpteacher GPTeacher/Roleplay/roleplay-simple-deduped-roleplay-instruct.json ...]
    -> OUT/prompts/{train,gsm8k_heldout,humaneval,mt_bench}.jsonl (rows of "prompt"), gsm8k_train.jsonl, and
       gpteacher_roleplay.jsonl, gpteacher_codegen.jsonl (each by the first word of its file's name)

The train split is not in ../shared: it is ``grade_school_math/data/train.jsonl`` of
github.com/openai/grade-school-math (MIT), worded as the test split's questions are. GPTeacher's sets are
``Roleplay/roleplay-simple-deduped-roleplay-instruct.json`` and ``Codegen/codegen-instruct.json`` of
github.com/teknium1/GPTeacher (MIT): each instruction with its input after a blank line, as `dflash bench` words
Alpaca's rows.
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
    p.add_argument("--gpteacher", type=Path, nargs="+", default=[],
                   help="GPTeacher's sets (JSON of instruction, input, response)")
    args = p.parse_args()
    data = args.shared / "datasets"
    gsm8k = rows_of(data / "gsm8k_test.jsonl")
    extra = rows_of(args.gsm8k_train) if args.gsm8k_train else []
    if set(extra) & set(gsm8k):  # checked before anything is written
        sys.exit(f"{args.gsm8k_train}: holds questions of GSM8K's test split; pass the train split")
    held_out = ([turn for sample in load_file(data / "mt_bench_questions.jsonl")[1] for turn in sample.turns]
                + [row["question"] for row in read_rows(data / "gsm8k_test.jsonl")[GSM8K_TRAIN_ROWS:]]
                + [row["prompt"] for row in read_rows(data / "humaneval.jsonl.gz")])
    sets = {path: instructions_of(path) for path in args.gpteacher}
    for path, prompts in sets.items():
        if any(text.strip() in prompt for prompt in prompts for text in held_out):  # as worded: stripped
            sys.exit(f"{path}: holds an MT-Bench turn, a held-out GSM8K question or a HumanEval task")
    args.out.mkdir(parents=True, exist_ok=True)
    train = gsm8k[:GSM8K_TRAIN_ROWS] + rows_of(data / "math500_test.jsonl") + rows_of(data / "mbpp_sanitized_test.jsonl")
    random.Random(0).shuffle(train)  # every shard holds each set: a run cut short is still balanced
    write(args.out / "train.jsonl", train)
    write(args.out / "gsm8k_heldout.jsonl", gsm8k[GSM8K_TRAIN_ROWS:])
    write(args.out / "humaneval.jsonl", rows_of(data / "humaneval.jsonl.gz"))
    write(args.out / "mt_bench.jsonl", rows_of(data / "mt_bench_questions.jsonl"))
    if args.gsm8k_train:
        write(args.out / "gsm8k_train.jsonl", extra)
    for path, prompts in sets.items():
        write(args.out / f"gpteacher_{path.stem.split('-')[0].lower()}.jsonl", prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
