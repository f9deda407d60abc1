#!/usr/bin/env python3
"""A target's linear layers as mlx-lm keeps them (``x @ weight.T``, a transposed view) against a
contiguous ``[in, out]`` copy of each weight: one forward of 1, 4 and 16 tokens after a prompt, and
the tied head alone, on MLX's CPU backend. The copy changes which BLAS kernel runs, so the logits'
bits differ from mlx-lm's: the share of differing logits is printed with the times.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/weight_layout.py --model OUT/smol
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from dflash_mlx import load
from dflash_mlx.targets import fused

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 6


def contiguous_copies(model) -> None:
    """Every fused linear layer computes ``x @ W`` with ``W`` a contiguous copy of ``weight.T``."""
    for m in model.modules():
        if type(m) is fused.FusedLinear:
            copy = mx.contiguous(m["weight"].T)
            mx.eval(copy)
            object.__setattr__(m, "_transposed", (m["weight"], copy))


def forwards(target, ids, widths, repeats):
    """{width: (median ms, logits [width, V] as numpy)} of one forward after the prompt, rolled back each time."""
    cache = target.make_cache(16)
    mx.eval(target(mx.array([ids]), cache)[0])
    out = {}
    for w in widths:
        x, times = mx.array([ids[:w]]), []
        for _ in range(repeats):
            tic = time.perf_counter()
            logits = target.lm_head(target(x, cache)[0])
            mx.eval(logits)
            times.append(time.perf_counter() - tic)
            target.rollback(cache, [w])
        out[w] = (1e3 * statistics.median(times), np.array(logits[0]))
    return out


def head_times(embedding: mx.array, widths, repeats):
    """{width: (ms as a view, ms as a contiguous copy)} of the tied head ``x @ E.T``."""
    copy = mx.contiguous(embedding.T)
    mx.eval(copy)
    out = {}
    for w in widths:
        x = mx.random.normal((1, w, embedding.shape[1]))
        row = []
        for weight in (embedding.T, copy):
            mx.eval(x @ weight)
            tic = time.perf_counter()
            for _ in range(repeats):
                mx.eval(x @ weight)
            row.append(1e3 * (time.perf_counter() - tic) / repeats)
        out[w] = tuple(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    pair = load(args.model)
    target, ids = pair.target, pair.tokenizer.encode(PROMPT)
    view = forwards(target, ids, args.widths, args.repeats)
    contiguous_copies(target.model)
    copy = forwards(target, ids, args.widths, args.repeats)
    print("| tokens | view ms | contiguous ms | ratio | logits whose bits differ |")
    print("|---:|---:|---:|---:|---:|")
    for w in args.widths:
        (a, la), (b, lb) = view[w], copy[w]
        differ = (la.view(np.int32) != lb.view(np.int32)).mean()
        print(f"| {w} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {100 * differ:.0f}% |")
    embedding = getattr(target.model, "model", target.model).embed_tokens.weight
    for w, (a, b) in head_times(embedding, args.widths, args.repeats).items():
        print(f"tied head, {w} rows: {a:.1f} ms as a view, {b:.1f} ms as a contiguous copy")


if __name__ == "__main__":
    main()
