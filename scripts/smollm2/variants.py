#!/usr/bin/env python3
"""More distinct training prompts for the SmolLM2 drafter: the training prompts that ask for step-by-step
reasoning (GSM8K rows 0-999 and MATH-500) with every whole number replaced by another of its size, so the
target's replies take other arithmetic (and often other paths) through the same kind of text.

Only `train.jsonl` is read: the evaluation prompts (GSM8K from row 1,000, HumanEval, MT-Bench) are never
touched, so no variant can be one of them.

    python scripts/smollm2/variants.py --prompts OUT/prompts/train.jsonl --seed 1 --out OUT/prompts/variants1.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.]*\d)")  # a whole number, not part of a word or a decimal


def vary(text: str, rng: random.Random) -> str:
    """``text`` with each whole number n >= 3 replaced by one drawn from [ceil(n / 2), 2n] (0-2 kept: they are
    often words in disguise, as 1 in "1 apple")."""
    def swap(m: re.Match) -> str:
        n = int(m.group())
        return m.group() if n < 3 else str(rng.randint((n + 1) // 2, 2 * n))

    return NUMBER.sub(swap, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="train.jsonl of scripts/smollm2/prompts.py")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rng = random.Random(args.seed)
    rows = [json.loads(line)["prompt"] for line in args.prompts.open() if line.strip()]
    out = [v for r in rows if "step by step" in r and (v := vary(r, rng)) != r]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": v}) + "\n" for v in out))
    tmp.rename(args.out)
    print(f"{args.out}: {len(out)} prompts, varied from {len(rows)}")


if __name__ == "__main__":
    main()
