#!/usr/bin/env python3
"""The SmolLM2 drafter's prompt files, from ../shared/datasets, worded as `dflash bench` asks them.

Training (the paper's recipe: the target regenerates the responses): GSM8K rows 0-999, MATH-500 and MBPP;
with ``--gsm8k-train``, also GSM8K's own train split (7,473 questions, none of them in its test split).
Evaluation, never trained on: GSM8K rows 1,000 on, HumanEval and MT-Bench first turns.

    python scripts/smollm2/prompts.py --shared ../shared --out OUT/prompts \
        [--gsm8k-train grade-school-math/grade_school_math/data/train.jsonl]
    -> OUT/prompts/{train,gsm8k_heldout,humaneval,mt_bench}.jsonl (rows of "prompt"), and gsm8k_train.jsonl

The train split is not in ../shared: it is ``grade_school_math/data/train.jsonl`` of
github.com/openai/grade-school-math (MIT), worded as the test split's questions are.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GSM8K_TRAIN_ROWS = 1000  # rows 0-999 train; rows from 1,000 on are held out


def rows_of(path: Path) -> list:
    sys.path.insert(0, str(ROOT))
    from dflash_mlx.bench.datasets import load_file

    return [s.turns[0] for s in load_file(path)[1]]


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
    args = p.parse_args()
    data = args.shared / "datasets"
    gsm8k = rows_of(data / "gsm8k_test.jsonl")
    extra = rows_of(args.gsm8k_train) if args.gsm8k_train else []
    if set(extra) & set(gsm8k):  # checked before anything is written
        sys.exit(f"{args.gsm8k_train}: holds questions of GSM8K's test split; pass the train split")
    args.out.mkdir(parents=True, exist_ok=True)
    train = gsm8k[:GSM8K_TRAIN_ROWS] + rows_of(data / "math500_test.jsonl") + rows_of(data / "mbpp_sanitized_test.jsonl")
    random.Random(0).shuffle(train)  # every shard holds each set: a run cut short is still balanced
    write(args.out / "train.jsonl", train)
    write(args.out / "gsm8k_heldout.jsonl", gsm8k[GSM8K_TRAIN_ROWS:])
    write(args.out / "humaneval.jsonl", rows_of(data / "humaneval.jsonl.gz"))
    write(args.out / "mt_bench.jsonl", rows_of(data / "mt_bench_questions.jsonl"))
    if args.gsm8k_train:
        write(args.out / "gsm8k_train.jsonl", extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
