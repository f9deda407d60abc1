#!/usr/bin/env python3
"""Where one DFlash verify cycle spends its time, measured on the engine itself.

Runs ``dflash_mlx.decode.generate.generate_step`` (not a copy of it) with a
:class:`~dflash_mlx.bench.simulate.SimulatedDrafter`, so the acceptance is known, and
reports the engine's own phases per cycle (draft, verify, host) plus the rest of
the wall time. With ``--profile`` it also prints the Python functions where the
host time goes (cProfile, cumulative), which is how the statement-level view of
the loop is obtained without mirroring it here.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/loop_profile.py --model models/stories260K \\
        --draft-model models/random-drafter-b16 --accept 5 --block-size 16
    # the random Qwen3-0.6B-shaped pair of benchmarks/simulated_speedup.py instead:
    python benchmarks/loop_profile.py --qwen3-0.6b --accept 5 --block-size 16 --tokens 48

Another tree's engine (before a change) is profiled by putting it first on the
path: ``PYTHONPATH=/tmp/before python benchmarks/loop_profile.py ...``.
"""

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.bench.runner import greedy_continuation
from dflash_mlx.decode.generate import generate_step
from dflash_mlx.bench.simulate import SimulatedDrafter
from dflash_mlx.stats import PHASES, GenerationStats


def run(target, drafter, ids, B, n_tokens) -> tuple:
    """One generation; returns (stats, wall seconds after the first token)."""
    stats = GenerationStats(block_size=B)
    first = None
    for step in generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=n_tokens,
                              block_size=B, stats=stats):
        first = first or time.perf_counter()
    return stats, time.perf_counter() - first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft-model")
    p.add_argument("--qwen3-0.6b", dest="qwen", action="store_true",
                   help="the random Qwen3-0.6B-shaped pair (32 random prompt tokens) instead of --model")
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--accept", type=int, default=5, help="A, drafts accepted per block")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also print the top functions by cumulative time")
    args = p.parse_args()

    if args.qwen:
        sys.path.insert(0, str(Path(__file__).parent))
        from simulated_speedup import random_pair

        _, target, bound = random_pair(1, args.block_size)
        mx.random.seed(1)
        ids = mx.random.randint(0, 151643, (32,)).tolist()
    else:
        pair = load(args.model, args.draft_model)
        target, bound, ids = pair.target, pair.drafter, pair.tokenizer.encode(args.prompt)
    sequence = greedy_continuation(target, ids, args.tokens + args.block_size, ())
    drafter = SimulatedDrafter(bound, sequence, args.accept, target.vocab_size)
    for _ in range(2):  # warm-up
        run(target, drafter, ids, args.block_size, args.tokens)
    profiler = cProfile.Profile() if args.profile else None
    total, wall = GenerationStats(block_size=args.block_size), 0.0
    for _ in range(args.runs):
        if profiler:
            profiler.enable()
        stats, seconds = run(target, drafter, ids, args.block_size, args.tokens)
        if profiler:
            profiler.disable()
        total.add(stats)
        wall += seconds
    cycles = total.steps
    phases = {p: total.phase_s[p] for p in PHASES if p != "prefill"}
    phases["other (consumer, between phases)"] = wall - sum(phases.values())
    print(f"{cycles} cycles, {1e3 * wall / cycles:.3f} ms per cycle, tau {total.tau:.2f} "
          f"(B={args.block_size}, A={args.accept})")
    print("| phase | ms/cycle | share |\n|---|---:|---:|")
    for name, s in phases.items():
        print(f"| {name} | {1e3 * s / cycles:.3f} | {100 * s / wall:.1f}% |")
    host = getattr(total, "host_s", None)  # engines before issue 19 did not book host work apart
    row = {"ms_per_cycle": 1e3 * wall / cycles, "tau": total.tau,
           **{name: 1e3 * s / cycles for name, s in phases.items()},
           "host_ms_per_step": None if host is None else 1e3 * host / cycles}
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
