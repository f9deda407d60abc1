#!/usr/bin/env python3
"""Where one DFlash verify cycle spends its time, statement by statement.

The loop below mirrors the greedy path of ``dflash_mlx.generate.generate_step``
(as of commit ea1253e, where greedy verify takes the argmax of the logits)
(draft wait, verify, acceptance, rollback, next draft) with a timer around every
statement, so the engine's "host" phase can be split into its parts. It uses the
library's own pieces (``prefill``, the target adapter, the drafter) and a
:class:`~dflash_mlx.simulate.SimulatedDrafter` so that the acceptance is known.
If ``generate_step`` changes, update this mirror.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/loop_profile.py --model models/stories260K \\
        --draft-model models/random-drafter-b16 --accept 5 --block-size 16
"""

import argparse
import time
from collections import defaultdict

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx import load
from dflash_mlx.bench.runner import greedy_continuation
from dflash_mlx.generate import count_accepted, prefill
from dflash_mlx.simulate import SimulatedDrafter


def cycle(target, drafter, ids, B, n_tokens, T):
    """One generation; adds seconds per statement to ``T`` and counts cycles in ``T['cycles']``."""
    cache, dcache = target.make_cache(B), drafter.make_cache()
    capture = drafter.target_layer_ids
    with mx.stream(generation_stream):
        h, context = prefill(target, mx.array(ids, dtype=mx.int32), cache, capture)
        t = mx.argmax(target.lm_head(h[:, -1]), axis=-1)
        mx.eval(t)
        drafts = drafter.draft(t, context, dcache, B)
        mx.async_eval(drafts)
        n = 1
        while n < n_tokens:
            marks = [time.perf_counter()]

            def mark(name):
                marks.append(time.perf_counter())
                T[name] += marks[-1] - marks[-2]

            mx.eval(drafts); mark("draft: wait (engine 'draft')")
            hh, features = target(mx.concatenate([t, drafts])[None], cache, capture)
            y = mx.argmax(target.lm_head(hh)[0], axis=-1); mark("verify: build graph")
            mx.eval(y, features); mark("verify: eval")
            y_list = y.tolist(); mark("host: y.tolist")
            a = count_accepted(drafts.tolist(), y_list); mark("host: drafts.tolist + accept")
            target.rollback(cache, B - 1 - a); mark("host: rollback")
            t, f = y[a: a + 1], features[:, : a + 1]; mark("host: slices")
            drafts = drafter.draft(t, f, dcache, B); mark("host: drafter.draft (build graph)")
            mx.async_eval(drafts); mark("host: mx.async_eval(drafts)")
            n += a + 1
            T["cycles"] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--accept", type=int, default=5, help="A, drafts accepted per block")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()

    pair = load(args.model, args.draft_model)
    ids = pair.tokenizer.encode(args.prompt)
    sequence = greedy_continuation(pair.target, ids, args.tokens + args.block_size, ())
    drafter = SimulatedDrafter(pair.drafter, sequence, args.accept, pair.target.vocab_size)
    for _ in range(2):  # warm-up
        cycle(pair.target, drafter, ids, args.block_size, args.tokens, defaultdict(float))
    T = defaultdict(float)
    for _ in range(args.runs):
        cycle(pair.target, drafter, ids, args.block_size, args.tokens, T)
    cycles = T.pop("cycles")
    total = sum(T.values())
    print(f"{int(cycles)} cycles, {1e3 * total / cycles:.3f} ms per cycle (B={args.block_size}, A={args.accept})")
    print("| statement | ms/cycle | share |\n|---|---:|---:|")
    for name, s in T.items():
        print(f"| {name} | {1e3 * s / cycles:.3f} | {100 * s / total:.1f}% |")


if __name__ == "__main__":
    main()
