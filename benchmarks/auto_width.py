#!/usr/bin/env python3
"""``--block-size auto`` against fixed block sizes and plain mlx-lm, at Qwen3-0.6B's shape.

Two questions (issue 14), on the random-weight Qwen3-0.6B-shaped target and random
1-layer drafter of ``benchmarks/simulated_speedup.py``, random prompts:

1. With the random drafter as it is (never right), is ``auto`` at least 0.95x plain
   mlx-lm? (A fixed block always loses here.)
2. With replayed acceptance traces (``--trace FILE``: the accepted lengths a real run
   recorded, ``dflash generate --json`` output at the trained block size, one block
   after another), is ``auto`` within 5% of the best fixed B?
3. With simulated acceptance A (the real drafter runs for its cost, its proposals are
   the target's continuation for A slots), is ``auto`` within 5% of the best fixed B?

Every engine runs on every prompt in this one process, the order reversed on every
other prompt, through the same runner as ``dflash bench``; figures are medians of
per-prompt ratios to mlx-lm.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        flock /tmp/dflash-bench.lock python benchmarks/auto_width.py --accepts 1 3 7 \\
        --max-tokens 64 --num-prompts 3 --out docs/bench/auto-qwen3-0.6b
    # traces recorded on a real pair (see docs/benchmarks.md), no random-drafter row:
    python benchmarks/auto_width.py --accepts --no-random --trace stories.jsonl --trace gsm8k.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx.bench.datasets import Sample
from dflash_mlx.bench.engines import MlxLmEngine
from dflash_mlx.bench.report import build_report, write_report
from dflash_mlx.bench.runner import BenchConfig, Runner
from dflash_mlx.cli.bench_tables import results_table
from dflash_mlx.bench.simulate import read_trace

sys.path.insert(0, str(Path(__file__).parent))
from simulated_speedup import SHAPES, random_pair  # noqa: E402


def run(runner: Runner, samples, name: str):
    tic = time.perf_counter()
    result = runner.run_dataset(name, samples)
    print(f"{name}: {time.perf_counter() - tic:.1f} s", file=sys.stderr)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accepts", type=int, nargs="*", default=[1, 3, 7], help="simulated A values")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--trace", type=Path, action="append", default=[],
                   help="an acceptance trace to replay (dflash generate --json output, JSON lines)")
    p.add_argument("--no-random", action="store_true", help="skip the random-drafter row")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="the random target's shape")
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--bits", type=int, default=None, help="quantize target and drafter (mlx-lm, group size 64)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model, target, drafter = random_pair(args.drafter_layers, max(args.block_sizes), shape=args.shape, bits=args.bits)
    mx.random.seed(1)
    samples = [Sample(f"random-{i}", prompt_ids=mx.random.randint(0, 151643, (args.prompt_tokens,)).tolist())
               for i in range(args.num_prompts)]
    base = MlxLmEngine(model)
    results = []
    if not args.no_random:
        config = BenchConfig(max_tokens=args.max_tokens, block_sizes=[max(args.block_sizes), "auto"], warmup_tokens=8)
        results.append(run(Runner(target, drafter, base, config, stop_ids=()), samples, "random drafter"))
    for path in args.trace:
        trace = read_trace(path)
        config = BenchConfig(max_tokens=args.max_tokens, block_sizes=[*args.block_sizes, "auto"],
                             simulate_acceptance=trace, warmup_tokens=8)
        name = f"trace {path.stem} (tau {1 + sum(trace) / len(trace):.2f} at B={max(args.block_sizes)})"
        results.append(run(Runner(target, drafter, base, config, stop_ids=()), samples, name))
    for a in args.accepts:
        config = BenchConfig(max_tokens=args.max_tokens, block_sizes=[*args.block_sizes, "auto"],
                             simulate_acceptance=a, warmup_tokens=8)
        results.append(run(Runner(target, drafter, base, config, stop_ids=()), samples, f"simulated A={a}"))
    cfg = dict(vars(args), trace=[str(t) for t in args.trace], target=f"random {args.shape} shape ({'float32' if args.bits is None else f'{args.bits}-bit'})",
               baseline="mlx-lm", drafter=f"random {args.drafter_layers}-layer DFlash drafter of the target's width")
    report = build_report(results, cfg, ["python", *sys.argv])
    from rich.console import Console

    Console(width=120).print(results_table(report))
    print("\n| prompts | engine | tau | speedup vs mlx-lm (median of ratios) |")
    print("|---|---|---:|---:|")
    for ds in report["datasets"]:
        for d in ds["dflash"]:
            name = f"B={d['block_size']}" if isinstance(d["block_size"], int) else d["block_size"]
            print(f"| {ds['name']} | {name} | {d['tau'] or 0:.2f} | {d['speedup_median_of_ratios']:.2f}x |")
    if args.out:
        write_report(report, Path(args.out))
        print(f"wrote {args.out}/results.json", file=sys.stderr)
    verdict = {ds["name"]: {str(d["block_size"]): d["speedup_median_of_ratios"] for d in ds["dflash"]}
               for ds in report["datasets"]}
    print(json.dumps(verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
