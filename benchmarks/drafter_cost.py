#!/usr/bin/env python3
"""Draft cost of candidate drafter shapes for a target, against its own decode steps.

For each shape (layers x MLP width x attention heads) a random drafter bound to the
target drafts one block the way the engine does: the block ``[t, MASK x (B-1)]``
plus ``--new-context`` new context rows, over ``--context`` cached rows, evaluated.
The drafter cache is trimmed back after each draft, so the context stays the same.
Shapes and the target's plain 1-token step and B-token verify alternate round by
round in this process; the medians are reported in ms and as multiples of the plain
step (a speculative step costs draft + verify, and commits tau tokens).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        flock /tmp/dflash-bench.lock python benchmarks/drafter_cost.py OUT/target \\
        --layers 1 2 3 --intermediate-sizes 128 256 512 --heads 8 4

Together with the tau each shape reaches (same training protocol), this picks the
shape by tau per millisecond rather than by size (docs/benchmarks.md).
"""

import argparse
import itertools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.drafter.network import DFlashDrafter
from dflash_mlx.drafter.config import DrafterArgs
from dflash_mlx.pair.loading import bind_drafter


def drafter_of_shape(target, layers: int, intermediate: int, heads: int, block_size: int, layer_ids):
    a = target.args
    kv = min(heads, getattr(a, "num_key_value_heads", None) or heads)
    args = DrafterArgs(
        hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=target.hidden_size // heads, intermediate_size=intermediate,
        vocab_size=target.vocab_size, target_layer_ids=layer_ids, mask_token_id=target.vocab_size - 1,
        block_size=block_size, num_target_layers=target.num_layers,
        rms_norm_eps=getattr(a, "rms_norm_eps", 1e-6), rope_theta=float(getattr(a, "rope_theta", 10000.0)),
    )
    drafter = DFlashDrafter(args)
    mx.eval(drafter.parameters())
    return bind_drafter(drafter, target)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", type=Path)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--intermediate-sizes", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--heads", type=int, nargs="+", default=None, help="query heads (default: the target's)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=200, help="cached context rows")
    p.add_argument("--new-context", type=int, default=4, help="new context rows per draft (about tau)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=20, help="drafts per round and shape")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    pair = load(str(args.target))
    target, B = pair.target, args.block_size
    heads = args.heads or [target.args.num_attention_heads]
    K = len(args.target_layer_ids) * target.hidden_size
    mx.random.seed(0)
    context = mx.random.normal((1, args.context, K))
    new = mx.random.normal((1, args.new_context, K))
    token = mx.array([5], dtype=mx.int32)

    cases = {}
    for layers, inter, h in itertools.product(args.layers, args.intermediate_sizes, heads):
        d = drafter_of_shape(target, layers, inter, h, B, args.target_layer_ids)
        cache = d.make_cache()
        d.ingest(context, cache)
        mx.eval([c.state for c in cache])

        def draft(d=d, cache=cache):
            mx.eval(d.draft(token, new, cache, B))
            for c in cache:
                c.trim(args.new_context)
        cases[(layers, inter, h)] = draft

    tcache = target.make_cache(B)
    ids = mx.array([[7] * args.context])
    target(ids, tcache, args.target_layer_ids)
    mx.eval([c.state for c in tcache])

    def step(n):
        def run():
            h, f = target(mx.array([[9] * n]), tcache, args.target_layer_ids)
            mx.eval(target.lm_head(h), f)
            target.rollback(tcache, n)
        return run
    cases["plain"], cases["verify"] = step(1), step(B)

    times = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(args.rounds):
        for k, f in cases.items():
            tic = time.perf_counter()
            for _ in range(args.reps):
                f()
            times[k].append((time.perf_counter() - tic) / args.reps * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    plain = ms["plain"]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"plain step {plain:.3f} ms; {B}-token verify {ms['verify']:.3f} ms = {ms['verify'] / plain:.2f} plain steps")
    rows = []
    for key in cases:
        if key in ("plain", "verify"):
            continue
        layers, inter, h = key
        rows.append({"layers": layers, "intermediate_size": inter, "heads": h, "draft_ms": round(ms[key], 3),
                     "plain_steps": round(ms[key] / plain, 3)})
        print(f"layers {layers} MLP {inter} heads {h}: draft {ms[key]:.3f} ms = {ms[key] / plain:.2f} plain steps")
    if args.json_out:
        args.json_out.write_text(json.dumps({"command": shlex.join(sys.argv), "plain_ms": round(plain, 3),
                                             "verify_ms": round(ms["verify"], 3), "drafters": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
