#!/usr/bin/env python3
"""Check the Metal block-attention kernel on this Mac: accuracy against the reference, and speed.

At each context length (default 1K, 4K, 16K) it prints the kernel's largest error against
``block_attention_reference`` for each dtype, then the time of one drafter-attention call
(one drafter layer of one draft step; default Qwen3-8B drafter shapes: 32 query heads,
8 KV heads, head_dim 128, block 16) for the kernel, the reference, and the drafter's
pre-kernel path (context and block K/V concatenated, then mx.fast.scaled_dot_product_attention),
as medians of repeats and as ratios to that pre-kernel path measured in the same run.
The context K/V are slices of an mlx-lm KVCache, as in the drafter. Without Metal it says
so in one line and times the two other paths.

    python benchmarks/bench_kernel.py
    python benchmarks/bench_kernel.py --contexts 1024 4096 16384 --repeats 50 --window 2048 --causal
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from dflash_mlx.kernels.block_attention import attention_path, block_attention, block_attention_reference
from dflash_mlx.kernels.block_attention_metal import metal_block_attention

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def drafter_inputs(n_ctx: int, heads: int, kv_heads: int, head_dim: int, block: int, dtype: mx.Dtype, seed: int = 0):
    """Queries [1, heads, block, D]; context K/V [1, kv_heads, n_ctx, D] as KVCache slices; block K/V."""
    mx.random.seed(seed)
    normal = lambda h, rows: mx.random.normal((1, h, rows, head_dim)).astype(dtype)
    cache = KVCache()
    if n_ctx:
        ctx_k, ctx_v = cache.update_and_fetch(normal(kv_heads, n_ctx), normal(kv_heads, n_ctx))
    else:
        ctx_k = ctx_v = mx.zeros((1, kv_heads, 0, head_dim), dtype=dtype)
    arrays = [normal(heads, block), ctx_k, ctx_v, normal(kv_heads, block), normal(kv_heads, block)]
    mx.eval(arrays)
    return arrays


def concat_sdpa(q, ck, cv, bk, bv, scale, window, causal):
    """The drafter's attention before the kernel: concatenate, then one fused SDPA call."""
    keys = mx.concatenate([ck, bk], axis=2)
    values = mx.concatenate([cv, bv], axis=2)
    mask = None
    if window is not None or causal:
        n_ctx, block = ck.shape[2], bk.shape[2]
        i = mx.arange(block)[:, None] + n_ctx
        k = mx.arange(n_ctx + block)[None, :]
        mask = mx.ones((block, n_ctx + block), dtype=mx.bool_)
        if window is not None:
            mask = mask & (i - k < window)
        if causal:
            mask = mask & ((k < n_ctx) | (k <= i))
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def max_error(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def time_paths(paths, arrays, repeats: int):
    """Median ms per call of each path; the paths alternate within every repeat."""
    for fn in paths.values():  # warm-up (kernel compilation, allocations)
        mx.eval(fn(*arrays))
    times = {name: [] for name in paths}
    for r in range(repeats):
        order = list(paths.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            tic = time.perf_counter()
            mx.eval(fn(*arrays))
            times[name].append((time.perf_counter() - tic) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384], help="context rows C")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=16, help="block size B")
    p.add_argument("--window", type=int, default=None, help="sliding window W (default: none)")
    p.add_argument("--causal", action="store_true", help="causal in-block attention")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the timed calls (default bfloat16 with Metal, float32 without)")
    args = p.parse_args()

    path = attention_path()
    kernel_runs = path["block_attention"] == "metal"
    dtype = DTYPES[args.dtype] if args.dtype else (mx.bfloat16 if kernel_runs else mx.float32)
    shape = (f"{args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
             f"block {args.block}, window {args.window}, {'causal' if args.causal else 'bidirectional'}")
    print(f"MLX {mx.__version__}, device {mx.default_device()}; {shape}")
    if not kernel_runs:
        print(f"Metal kernel: cannot run here ({path['reason']}); timing the reference and concat + SDPA only.")
    scale = args.head_dim ** -0.5
    kw = dict(scale=scale, window=args.window, causal=args.causal)

    for n_ctx in args.contexts:
        print(f"\ncontext {n_ctx}")
        if kernel_runs:
            for name, dt in DTYPES.items():
                arrays = drafter_inputs(n_ctx, args.heads, args.kv_heads, args.head_dim, args.block, dt)
                got = block_attention(*arrays, **kw)
                assert attention_path(*arrays)["block_attention"] == "metal", attention_path(*arrays)
                err = max_error(got, block_attention_reference(*arrays, **kw))
                print(f"  kernel vs reference, {name:8s}: max |error| / max |reference| = {err:.2e}")
        arrays = drafter_inputs(n_ctx, args.heads, args.kv_heads, args.head_dim, args.block, dtype)
        err = max_error(concat_sdpa(*arrays, scale, args.window, args.causal), block_attention_reference(*arrays, **kw))
        print(f"  concat + SDPA vs reference, {dtype_name(dtype)}: max |error| / max |reference| = {err:.2e}")
        paths = {"concat + SDPA": lambda *a: concat_sdpa(*a, scale, args.window, args.causal),
                 "reference": lambda *a: block_attention_reference(*a, **kw)}
        if kernel_runs:
            paths["kernel"] = lambda *a: metal_block_attention(
                *a, scale, args.window, args.causal, a[1].shape[2])
        medians = time_paths(paths, arrays, args.repeats)
        base = medians["concat + SDPA"]
        for name, ms in medians.items():
            print(f"  {name:14s} {dtype_name(dtype):9s} {ms:9.3f} ms per call (median of {args.repeats}), "
                  f"{ms / base:5.2f}x the time of concat + SDPA")


if __name__ == "__main__":
    main()
