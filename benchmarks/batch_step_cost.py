#!/usr/bin/env python3
"""What one batched step costs in one process (issue 21): ops in its graph, the calling
thread's CPU time and the wall time, for N sequences at a fixed width, greedy.

On MLX's CPU backend a small model's step costs about its number of ops on two threads:
the calling thread builds the graph and dispatches every op (its CPU time here), and the
stream's thread runs the kernels. Pinned to one core, as the serve benchmarks pin a
server, the two add up. Ops are counted with ``mx.export_to_dot`` on what each step
evaluates (a separate pass: counting takes time); times are medians over ``--steps``
steps after ``--warmup`` untimed ones. Runs on older checkouts too (it only wraps
``mx.eval`` as the batch module sees it), so a change can be compared with its parent
from a worktree: ``cd WORKTREE && PYTHONPATH=. python /path/to/batch_step_cost.py ...``.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        taskset -c 0 python benchmarks/batch_step_cost.py --model OUT/target --draft-model OUT/drafter --width 4
"""

import argparse
import io
import re
import statistics
import time
import types

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.decode import batch as batch_module
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from story_openings import PROMPTS  # benchmarks/ is on the path when run as a script


def counting(counts: list):
    """A stand-in for ``mlx.core`` whose ``eval`` first counts the ops it will run."""
    def eval_counted(*args):
        arrays = []

        def walk(a):
            if isinstance(a, mx.array):
                arrays.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    walk(b)
        walk(args)
        dot = io.StringIO()
        mx.export_to_dot(dot, *arrays)
        counts.append(len(re.findall(r'label ="[A-Za-z]', dot.getvalue())))
        return mx.eval(*args)

    module = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    module.eval = eval_counted
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--width", type=int, default=4, help="block size verified every step")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    pair = load(args.model, args.draft_model)
    decoder = BatchDecoder(pair.target, pair.drafter, args.width)
    for k in range(args.sequences):  # no stop: every step has all sequences
        decoder.start(k, pair.tokenizer.encode(PROMPTS[k % len(PROMPTS)]), None, StopCondition(10**6, ())).advance()
    for _ in range(args.warmup):
        decoder.step()
    counts = []
    batch_module.mx = counting(counts)
    try:
        for _ in range(5):
            decoder.step()
    finally:
        batch_module.mx = mx
    cpu, wall = [], []
    for _ in range(args.steps):
        c, w = time.thread_time(), time.perf_counter()
        decoder.step()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    print(f"{args.sequences} sequences, width {args.width}: {statistics.median(counts):.0f} ops per step, "
          f"calling thread {1e3 * statistics.median(cpu):.2f} ms CPU, wall {1e3 * statistics.median(wall):.2f} ms "
          f"(medians of {args.steps} steps)")


if __name__ == "__main__":
    main()
