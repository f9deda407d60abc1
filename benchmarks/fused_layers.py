#!/usr/bin/env python3
"""A target's forward with its RMSNorm and RoPE fused (dflash_mlx.targets.fused) against
mlx-lm's own modules, same weights, one process.

Per width (tokens fed after a prompt, as a plain step or a verify), the fused and the
unfused copy alternate (10 rounds of 100 forwards, caches rolled back after each), and
each graph's ops are counted (``mx.export_to_dot``). Prints the median ms of each and
their ratio, and whether the logits are the same bits.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 taskset -c 0 \\
        python benchmarks/fused_layers.py --model OUT/target --draft-model OUT/drafter
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx import load
from chunked_prefill import prefill  # benchmarks/ is on the path when run as a script
from dflash_mlx.targets.fused import unfused

sys.path.insert(0, str(Path(__file__).parent))
from step_graphs import nodes  # noqa: E402  (ops by primitive, mx.export_to_dot)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily. She loved to play")
    args = p.parse_args()
    pair = load(args.model, args.draft_model)
    target, capture = pair.target, pair.drafter.target_layer_ids
    prompt = mx.array(pair.tokenizer.encode(args.prompt), dtype=mx.int32)
    print("command:", " ".join([sys.executable, *sys.argv]))
    print("| tokens | ops fused / unfused | ms fused | ms unfused | fused / unfused | same logits |")
    print("|---:|---|---:|---:|---:|---|")
    for width in args.widths:
        tokens = mx.array([(5 + 7 * i) % 200 for i in range(width)], dtype=mx.int32)
        with mx.stream(generation_stream):
            cache = target.make_cache(max(args.widths))
            prefill(target, prompt, cache, capture)
            mx.eval([c.state for c in cache])

            def forward(run=True):
                h, f = target(tokens[None], cache, capture)
                logits = target.lm_head(h)
                if run:
                    mx.eval(logits, f)
                    target.rollback(cache, width)
                return logits, f

            counts, outs, times = [], [], [[], []]
            for fused in (True, False):
                with unfused(pair.model) if not fused else nullcontext():
                    graph = forward(run=False)
                    counts.append(sum(nodes(*graph).values()))
                    mx.eval(graph)
                    target.rollback(cache, width)
                    outs.append(graph[0])
            for rnd in range(10):
                for k in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                    with unfused(pair.model) if k else nullcontext():
                        for _ in range(10):
                            forward()
                        tic = time.perf_counter()
                        for _ in range(100):
                            forward()
                        times[k].append((time.perf_counter() - tic) * 10)
        a, b = statistics.median(times[0]), statistics.median(times[1])
        same = mx.array_equal(outs[0], outs[1]).item()
        print(f"| {width} | {counts[0]} / {counts[1]} | {a:.2f} | {b:.2f} | {a / b:.3f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
