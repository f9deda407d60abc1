#!/usr/bin/env python3
"""What one step's graphs cost, ours against the authors' reference loop, same pair.

For a 16-token verify (target forward with feature capture, greedy pick) and a
16-token draft (the drafter's pass over 4 new context rows), each side's graph is
built and evaluated alone, many times (median of 5 rounds of 300), with the caches
rolled back after each; and the graph's nodes are counted by primitive
(``mx.export_to_dot``). On MLX's CPU backend every node is a task handed to the
stream's thread, so at stories260K's size a step costs its node count, not its flops.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 taskset -c 0 \\
        python benchmarks/step_graphs.py --model OUT/target --draft-model OUT/drafter \\
        --reference z-lab-dflash/dflash/model_mlx.py
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

sys.path.insert(0, str(Path(__file__).parent))
import reference_loop as rl  # noqa: E402

from dflash_mlx import load  # noqa: E402
from chunked_prefill import prefill  # noqa: E402

B, NEW_ROWS = 16, 4


def median_ms(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        tic = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - tic) / n * 1e3)
    return statistics.median(rounds)


def nodes(*outputs) -> collections.Counter:
    path = tempfile.mktemp(suffix=".dot")
    mx.export_to_dot(path, *outputs)
    return collections.Counter(re.findall(r'label ="([A-Za-z_]+)', Path(path).read_text()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--reference", type=Path, required=True, help="the authors' dflash/model_mlx.py")
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily. She loved to play")
    args = p.parse_args()

    ref = rl.import_reference(args.reference)
    pair = load(args.model, args.draft_model)
    model, _ = mlx_lm_load(args.model)
    draft = rl.reference_drafter(ref, Path(args.draft_model))
    rl.normed_last_layer(ref, model, list(draft.config.target_layer_ids))
    draft.bind(model)
    prompt = mx.array(pair.tokenizer.encode(args.prompt), dtype=mx.int32)
    tokens = mx.array([5] * B, dtype=mx.int32)
    target, drafter, capture = pair.target, pair.drafter, pair.drafter.target_layer_ids

    with mx.stream(generation_stream):
        cache = target.make_cache(B)
        _, context = prefill(target, prompt, cache, capture)
        draft_cache = drafter.make_cache()
        drafter.ingest(context, draft_cache)
        their_cache, their_draft_cache = make_prompt_cache(model), make_prompt_cache(draft)
        model(prompt[None], their_cache)
        hidden = mx.concatenate(model._hidden_states, axis=-1)
        draft(tokens[None, :1], hidden, their_draft_cache)
        mx.eval(context, hidden, [c.state for c in cache + draft_cache + their_cache + their_draft_cache])
    rows, their_rows = context[:, -NEW_ROWS:], hidden[:, -NEW_ROWS:]

    def our_verify(run=True):
        h, f = target(tokens[None], cache, capture)
        out = mx.argmax(target.lm_head(h)[0], axis=-1)
        if not run:
            return out, f
        mx.eval(out, f)
        target.rollback(cache, B)

    def their_verify(run=True):
        logits = model(tokens[None], their_cache)
        out, h = mx.argmax(logits, axis=-1), mx.concatenate(model._hidden_states, axis=-1)
        if not run:
            return out, h
        mx.eval(out, h)
        trim_prompt_cache(their_cache, B)

    def our_draft(run=True):
        out = drafter.propose(tokens[:1], rows, draft_cache, B).tokens
        if not run:
            return (out,)
        mx.eval(out)
        for c in draft_cache:
            c.trim(NEW_ROWS)

    def their_draft(run=True):
        block = mx.array([[5] + [draft.config.mask_token_id] * (B - 1)])
        out = mx.argmax(draft(block, their_rows, their_draft_cache)[:, 1 - B:], axis=-1)
        if not run:
            return (out,)
        mx.eval(out)
        trim_prompt_cache(their_draft_cache, NEW_ROWS)

    report = {}
    with mx.stream(generation_stream):
        for name, fn, roll in (("verify ours", our_verify, lambda: target.rollback(cache, B)),
                               ("verify theirs", their_verify, lambda: trim_prompt_cache(their_cache, B)),
                               ("draft ours", our_draft, lambda: [c.trim(NEW_ROWS) for c in draft_cache]),
                               ("draft theirs", their_draft, lambda: trim_prompt_cache(their_draft_cache, NEW_ROWS))):
            counts = nodes(*fn(run=False))
            roll()  # building the graph already wrote the caches' rows
            report[name] = {"ms": round(median_ms(fn), 3), "nodes": sum(counts.values()),
                            "top": dict(counts.most_common(8))}
    print("command:", " ".join([sys.executable, *sys.argv]))
    print("| graph (B=16) | ms (built and evaluated alone) | nodes |")
    print("|---|---:|---:|")
    for name, r in report.items():
        print(f"| {name} | {r['ms']:.2f} | {r['nodes']} |")
    print(json.dumps({k: v["top"] for k, v in report.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
