#!/usr/bin/env python3
"""``--block-size auto`` against every fixed block size, in one process, on a real pair.

For each prompt, each setting decodes greedily 3 times (order reversed every other
repeat, after one warm-up generation per setting); decode speed is tokens after the
first over the time from the first token to the last. Reported: per setting, the
median over prompts of its speed over the best fixed setting's on that prompt; tau;
the widths auto chose. Every setting's tokens must equal the first run's (exactness).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 taskset -c 0 \\
        python benchmarks/auto_vs_fixed.py --model OUT/target --draft-model OUT/drafter \\
        --prompts scripts/data/story_openings.jsonl --skip 10 -n 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx import GenerationStats, generate_step, load

ROOT = Path(__file__).resolve().parents[1]


def prompts_from(path: Path, skip: int, n: int) -> list:
    if path.suffix == ".jsonl" and path.name == "story_openings.jsonl":
        rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
        return rows[skip: skip + n]
    from dflash_mlx.bench.datasets import load_dataset

    return [s.turns[0] for s in load_dataset(str(path), skip + n)[1]][skip:]


def decode(pair, ids, setting, max_tokens):
    stats = GenerationStats(block_size=pair.drafter.block_size)
    tokens, first, last = [], None, None
    for step in generate_step(mx.array(ids, dtype=mx.int32), pair.target, pair.drafter, max_tokens=max_tokens,
                              block_size=setting, stop_token_ids=pair.tokenizer.eos_token_ids, stats=stats):
        last = time.perf_counter()
        first = first or last
        tokens += step.tokens
    return (len(tokens) - 1) / (last - first), stats, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    p.add_argument("--skip", type=int, default=10, help="prompts skipped first (the script trains on none of them)")
    p.add_argument("-n", "--num-prompts", type=int, default=8)
    p.add_argument("-m", "--max-tokens", type=int, default=256)
    p.add_argument("--settings", nargs="+", default=["auto", "4", "8", "16"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    pair = load(args.model, args.draft_model)
    settings = [s if s == "auto" else int(s) for s in args.settings]
    fixed = [s for s in settings if s != "auto"]
    prompts = [pair.tokenizer.encode(t) for t in prompts_from(args.prompts, args.skip, args.num_prompts)]
    for s in settings:
        decode(pair, prompts[0], s, 32)
    speed = {s: [] for s in settings}
    tau = {s: [] for s in settings}
    widths = []
    for ids in prompts:
        runs = {s: [] for s in settings}
        reference = None
        for r in range(args.repeats):
            for s in settings if r % 2 == 0 else settings[::-1]:
                tps, stats, tokens = decode(pair, ids, s, args.max_tokens)
                reference = reference or tokens
                if tokens != reference:
                    raise SystemExit(f"setting {s}: tokens differ from the first run's")
                runs[s].append(tps)
                if r == 0:
                    tau[s].append(stats.tau)
                    if s == "auto":
                        widths.append(dict(stats.widths))
        for s in settings:
            speed[s].append(statistics.median(runs[s]))
    best = [max(speed[s][i] for s in fixed) for i in range(len(prompts))]
    print("command:", " ".join([sys.executable, *sys.argv]))
    print("| setting | speed over the best fixed B (median of per-prompt ratios) | tau |")
    print("|---|---:|---:|")
    for s in settings:
        ratio = statistics.median(speed[s][i] / best[i] for i in range(len(prompts)))
        print(f"| {s} | {ratio:.3f} | {statistics.mean(tau[s]):.2f} |")
    for i in range(len(prompts)):
        print(f"prompt {args.skip + i}: " + ", ".join(f"{s} {speed[s][i] / best[i]:.3f}" for s in settings)
              + f"; auto's widths {json.dumps(widths[i])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
