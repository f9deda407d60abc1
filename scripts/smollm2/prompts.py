#!/usr/bin/env python3
"""The SmolLM2 drafter's prompt files, from ../shared/datasets, worded as `dflash bench` asks them.

Training (the paper's recipe: the target regenerates the responses): GSM8K rows 0-999, MATH-500 and MBPP.
Evaluation, never trained on: GSM8K rows 1,000 on, HumanEval and MT-Bench first turns.

    python scripts/smollm2/prompts.py --shared ../shared --out OUT/prompts
    -> OUT/prompts/{train,gsm8k_heldout,humaneval,mt_bench}.jsonl (rows of "prompt")
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
    args = p.parse_args()
    data = args.shared / "datasets"
    args.out.mkdir(parents=True, exist_ok=True)
    gsm8k = rows_of(data / "gsm8k_test.jsonl")
    train = gsm8k[:GSM8K_TRAIN_ROWS] + rows_of(data / "math500_test.jsonl") + rows_of(data / "mbpp_sanitized_test.jsonl")
    random.Random(0).shuffle(train)  # every shard holds each set: a run cut short is still balanced
    write(args.out / "train.jsonl", train)
    write(args.out / "gsm8k_heldout.jsonl", gsm8k[GSM8K_TRAIN_ROWS:])
    write(args.out / "humaneval.jsonl", rows_of(data / "humaneval.jsonl.gz"))
    write(args.out / "mt_bench.jsonl", rows_of(data / "mt_bench_questions.jsonl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
