#!/usr/bin/env python3
"""Training-data throughput on this machine, before and after `dflash data` captured the target's features:

- before: responses from mlx-lm's ``batch_generate`` (what `dflash data` called, completion batch
  ``--batch-size``, prompts prefilled 8 at a time), then each sequence's features from one forward of
  the whole sequence (what `dflash train` computed in its first epoch);
- after: :func:`dflash_mlx.train.data.generate_batched` (the project's batched decoder, one sequence
  joining as another finishes), without and with the features captured as it generates.

One process, the same prompts (encoded through the chat template, shortest first) for each way, greedy.
Prints response tokens per second and sequences per second of each, and checks that every way gives
the same tokens.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/data_throughput.py --model OUT/smol --prompts OUT/prompts/train.jsonl -n 32
"""

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from dflash_mlx import load
from dflash_mlx.train.data import encode_prompts, generate_batched, read_prompt_file
from dflash_mlx.train.loss import target_features


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("-n", type=int, default=32, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--target-layer-ids", default="1,8,14,20,27")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from mlx_lm import batch_generate

    pair = load(args.model)
    ids = sorted(encode_prompts(pair.tokenizer, read_prompt_file(args.prompts)[: args.n]), key=len)
    layers = [int(i) for i in args.target_layer_ids.split(",")]
    budgets = [args.max_tokens] * len(ids)
    out = {}

    tic = time.perf_counter()
    before = batch_generate(pair.model, pair.tokenizer, ids, max_tokens=args.max_tokens, return_token_ids=True,
                            completion_batch_size=args.batch_size, prefill_batch_size=min(8, args.batch_size))
    gen_s = time.perf_counter() - tic
    tokens = sum(len(t) for t in before.token_ids)
    tic = time.perf_counter()
    for p, r in zip(ids, before.token_ids):
        mx.eval(target_features(pair.target, np.array(p + r, dtype=np.int32), layers, mx.float32))
    feat_s = time.perf_counter() - tic
    out["before"] = {"generate_s": gen_s, "features_s": feat_s, "response_tokens": tokens}

    for name, capture in (("after", None), ("after, features captured", layers)):
        tic = time.perf_counter()
        made = generate_batched(pair.target, ids, budgets, pair.tokenizer.eos_token_ids, args.batch_size,
                               capture=capture)
        if capture:
            mx.eval([f for _, f in made])
        seconds = time.perf_counter() - tic
        same = sum(t == b for (t, _), b in zip(made, before.token_ids))
        out[name] = {"generate_s": seconds, "features_s": 0.0 if capture else None,
                     "response_tokens": sum(len(t) for t, _ in made), "same_tokens": f"{same}/{len(ids)}"}

    for name, r in out.items():
        total = r["generate_s"] + (r["features_s"] or 0.0)
        r["tokens_per_s"] = round(r["response_tokens"] / r["generate_s"], 1)
        r["sequences_per_s_with_features"] = round(len(ids) / total, 3) if r["features_s"] is not None else None
        print(f"{name}: {r['tokens_per_s']} response tokens/s generating"
              + (f"; with features {r['sequences_per_s_with_features']} sequences/s" if r["features_s"] is not None
                 else "") + (f"; same tokens as before {r['same_tokens']}" if "same_tokens" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "prompts": len(ids), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
