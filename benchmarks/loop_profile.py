#!/usr/bin/env python3
"""Where one DFlash verify cycle spends its time, measured on the engine itself.

Runs ``dflash_mlx.generate.generate_step`` (not a copy of it) with a
:class:`~dflash_mlx.simulate.SimulatedDrafter`, so the acceptance is known, and
reports the engine's own phases per cycle (draft, verify, host) plus the rest of
the wall time. With ``--profile`` it also prints the Python functions where the
host time goes (cProfile, cumulative), which is how the statement-level view of
the loop is obtained without mirroring it here.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/loop_profile.py --model models/stories260K \\
        --draft-model models/random-drafter-b16 --accept 5 --block-size 16
"""

import argparse
import cProfile
import pstats
import time

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.bench.runner import greedy_continuation
from dflash_mlx.generate import generate_step
from dflash_mlx.simulate import SimulatedDrafter
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
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--accept", type=int, default=5, help="A, drafts accepted per block")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also print the top functions by cumulative time")
    args = p.parse_args()

    pair = load(args.model, args.draft_model)
    ids = pair.tokenizer.encode(args.prompt)
    sequence = greedy_continuation(pair.target, ids, args.tokens + args.block_size, ())
    drafter = SimulatedDrafter(pair.drafter, sequence, args.accept, pair.target.vocab_size)
    for _ in range(2):  # warm-up
        run(pair.target, drafter, ids, args.block_size, args.tokens)
    profiler = cProfile.Profile() if args.profile else None
    total, wall = GenerationStats(block_size=args.block_size), 0.0
    for _ in range(args.runs):
        if profiler:
            profiler.enable()
        stats, seconds = run(pair.target, drafter, ids, args.block_size, args.tokens)
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
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
