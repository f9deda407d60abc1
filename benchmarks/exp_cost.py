#!/usr/bin/env python3
"""What a forward's attention costs on this backend: ``mx.exp`` per element against an
add, then one target forward of 1 and of 16 tokens at several cache lengths, beside the
time its attention's exponentials alone would take (heads x tokens x (cached + tokens)
x layers, at the measured ns per ``exp``). Medians of 40 calls; the cache is trimmed back
after each call.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        taskset -c 0 python benchmarks/exp_cost.py --model OUT/target
"""

import argparse
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def median_ms(f, n: int = 40) -> float:
    f()
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        f()
        times.append(time.perf_counter() - tic)
    return 1000 * sorted(times)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="mlx-lm target folder")
    p.add_argument("--cached", default="32,128,256,448", help="cache lengths (tokens)")
    args = p.parse_args()
    x = mx.random.normal((1 << 20,))
    mx.eval(x)
    exp_ns = median_ms(lambda: mx.eval(mx.exp(x))) * 1e6 / x.size
    add_ns = median_ms(lambda: mx.eval(x + 1)) * 1e6 / x.size
    print(f"exp {exp_ns:.1f} ns per element, add {add_ns:.2f}")
    model, _ = load(args.model)
    heads, layers = model.args.num_attention_heads, model.args.num_hidden_layers
    print("| cached tokens | tokens | forward ms | attention exps | their time at the exp rate, ms |")
    print("|---:|---:|---:|---:|---:|")
    for cached in (int(c) for c in args.cached.split(",")):
        cache = make_prompt_cache(model)
        model(mx.zeros((1, cached), mx.int32), cache=cache)
        mx.eval([c.state for c in cache])

        def forward(n: int) -> None:
            model(mx.zeros((1, n), mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            for c in cache:
                c.trim(n)

        for n in (1, 16):
            ms = median_ms(lambda: forward(n))
            exps = heads * n * (cached + n) * layers
            print(f"| {cached} | {n} | {ms:.2f} | {exps} | {exps * exp_ns / 1e6:.2f} |")


if __name__ == "__main__":
    main()
