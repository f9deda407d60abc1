#!/usr/bin/env python3
"""Where a decode step's time goes: one target forward of W new tokens (W=1 is a plain step, W=B a
verify) and one draft of a block of B, for the drafter as stored and, where it is quantized, dequantized
to float32, each over a context of ``--context`` tokens; median of ``--repeats`` in one process.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/step_cost.py --model OUT/smol --draft-model examples/smollm2-135m/drafter

On MLX's CPU backend the quantized matmul is slower than float32 (the reason the figures in
docs/benchmarks.md are measured in float32); on a Mac it is the other way round.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.utils import dequantize_model

from dflash_mlx.pair.loading import is_quantized, load, quantization


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds, after two untimed calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 1)


def target_ms(target, context: int, widths, repeats: int) -> dict:
    """``{W: ms}`` of one forward of W tokens after ``context`` tokens (the cache trimmed back each time)."""
    cache = target.make_cache()
    mx.eval(target(mx.arange(1, context + 1)[None] % 1000, cache, [])[0])

    def forward(w):
        mx.eval(target(mx.full((1, w), 5), cache, [])[0])
        for c in cache:
            c.trim(w)

    return {w: median_ms(lambda: forward(w), repeats) for w in widths}


def draft_ms(drafter, context: int, blocks, repeats: int) -> dict:
    """``{B: ms}`` of one draft of a block of B, two new context rows each time (``context`` seen before)."""
    width = drafter.fc.weight.shape[-1]
    cache = drafter.make_cache()
    drafter.ingest(mx.random.normal((1, context, width)), cache)
    new, token = mx.random.normal((1, 2, width)), mx.array([7])

    def draft(b):
        mx.eval(drafter.draft(token, new, cache, b))
        for c in cache:
            c.trim(2)

    return {b: median_ms(lambda: draft(b), repeats) for b in blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    widths = [int(w) for w in a.widths.split(",")]
    pair = load(a.model, a.draft_model)
    result = {"context": a.context, "target_ms": target_ms(pair.target, a.context, widths, a.repeats),
              "drafter": {}}
    blocks = [w for w in widths if w > 1]
    result["drafter"][quantization(pair.drafter)] = draft_ms(pair.drafter, a.context, blocks, a.repeats)
    if is_quantized(pair.drafter):
        dequantize_model(pair.drafter)
        pair.drafter.set_dtype(mx.float32)
        result["drafter"]["dequantized to float32"] = draft_ms(pair.drafter, a.context, blocks, a.repeats)
    print(f"context {a.context} tokens; median ms of {a.repeats}")
    print("target forward of W tokens: " + ", ".join(f"W={w} {ms}" for w, ms in result["target_ms"].items()))
    for kind, row in result["drafter"].items():
        print(f"draft of B, drafter {kind}: " + ", ".join(f"B={b} {ms}" for b, ms in row.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
