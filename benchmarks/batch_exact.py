#!/usr/bin/env python3
"""Continuous batching is exact: many requests through one batch, each equal to its solo run.

``--requests`` requests (random prompts of the target's own text, random max_tokens,
random stop strings, some cancelled mid-decode) join a :class:`BatchDecoder` of at most
``--max-batch`` sequences at random steps, prefilled ``--prefill-step`` tokens per step,
as ``dflash serve`` schedules them. Each request's tokens are compared with the same
request run alone through ``dflash_mlx.decode.generate.generate_step`` (the code path
of ``dflash generate``; greedy): equal for the finished ones, a prefix for the
cancelled ones. Prints the counts and exits 1 on any difference.

    python benchmarks/batch_exact.py --model /tmp/b21/target --draft-model /tmp/b21/random-drafter \\
        --requests 200 --max-batch 8 --block-size 8
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from typing import Dict, List

import mlx.core as mx

from dflash_mlx import generate_step, load
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.width import make_chooser
from dflash_mlx.decode.generate import check_block_size
from dflash_mlx.decode.stopping import StopCondition

STOPS = [".", "!", " the", "\n", " and", "ed"]


def make_requests(tokenizer, n: int, seed: int, max_tokens: int) -> List[Dict]:
    """Random requests: prompts cut from text, lengths, stop strings, cancellations, join steps."""
    rng = random.Random(seed)
    text = ("Once upon a time there was a little girl named Lily. She loved to play outside in the sun. "
            "One day, she saw a big red ball in the park and ran to get it. Tom had a dog. The dog was happy.")
    words = text.split(" ")
    requests, step = [], 0
    for i in range(n):
        start = rng.randrange(len(words) - 1)
        prompt = tokenizer.encode(" ".join(words[start:start + rng.randint(1, 12)]))
        stop = tuple(rng.sample(STOPS, rng.randint(1, 2))) if rng.random() < 0.35 else ()
        step += rng.choice([0, 0, 1, 2, 5])
        cancel = step + rng.randint(1, 30) if rng.random() < 0.2 else None
        requests.append(dict(key=i, prompt=prompt, n=rng.randint(1, max_tokens), stop=stop, join=step,
                             cancel=cancel))
    return requests


def run_batch(decoder: BatchDecoder, requests: List[Dict], tokenizer, max_batch: int, chunk: int) -> Dict:
    """Schedule the requests as the server does; returns ``{key: tokens}``."""
    out = {r["key"]: [] for r in requests}
    waiting, joining, step = deque(requests), deque(), 0
    by_key = {r["key"]: r for r in requests}
    while waiting or joining or len(decoder):
        while waiting and waiting[0]["join"] <= step and len(joining) + len(decoder) < max_batch:
            r = waiting.popleft()
            stop = StopCondition(r["n"], tuple(tokenizer.eos_token_ids), r["stop"], tokenizer.decode)
            joining.append(decoder.start(r["key"], r["prompt"], None, stop, step_size=chunk))
        cancelled = [s.key for s in decoder.sequences if by_key[s.key]["cancel"] is not None
                     and by_key[s.key]["cancel"] <= step]
        decoder.remove(cancelled)
        if joining:
            result = joining[0].advance()
            if result is not None:
                out[joining.popleft().key] += result.tokens
        keys = [s.key for s in decoder.sequences]
        for key, result in zip(keys, decoder.step()):
            out[key] += result.tokens
        step += 1
    return out


def solo(pair, r: Dict, block_size: int) -> List[int]:
    stop = StopCondition(r["n"], tuple(pair.tokenizer.eos_token_ids), r["stop"], pair.tokenizer.decode)
    steps = generate_step(mx.array(r["prompt"], dtype=mx.int32), pair.target, pair.drafter, stop=stop,
                          block_size=block_size)
    return [t for s in steps for t in s.tokens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--block-size", default="8", help="B, or auto: widths chosen per batched step")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--prefill-step", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pair = load(args.model, args.draft_model)
    requests = make_requests(pair.tokenizer, args.requests, args.seed, args.max_tokens)
    tic = time.perf_counter()
    auto = args.block_size == "auto" and pair.drafter is not None
    width = check_block_size(args.block_size, pair.drafter)
    decoder = BatchDecoder(pair.target, pair.drafter, width, make_chooser(pair.target, pair.drafter, "auto" if auto else width, None))
    got = run_batch(decoder, requests, pair.tokenizer, args.max_batch, args.prefill_step)
    batch_s = time.perf_counter() - tic
    equal = prefix = differ = 0
    distinct = set()
    for r in requests:
        ref = solo(pair, r, width)  # greedy: the target's own tokens, whatever the block size
        distinct.update(ref)
        if r["cancel"] is not None and len(got[r["key"]]) < len(ref):
            ok = got[r["key"]] == ref[: len(got[r["key"]])]
            prefix += ok
        else:
            ok = got[r["key"]] == ref
            equal += ok
        if not ok:
            differ += 1
            print(f"request {r['key']} differs: batch {got[r['key']][:20]} solo {ref[:20]}")
    stopped = sum(1 for r in requests if r["stop"])
    steps_at = {w: sum(n for (v, _), n in decoder.widths.runs.items() if v == w) for w in decoder.widths.widths} \
        if auto else {}
    widths = f", steps per width {steps_at}" if auto else ""
    print(f"{args.requests} requests (max batch {args.max_batch}, block {args.block_size}{widths}, {stopped} with stop "
          f"strings, {sum(r['cancel'] is not None for r in requests)} with a cancel step): {equal} equal to their "
          f"solo run, {prefix} cancelled as a prefix of it, {differ} different; {len(distinct)} distinct tokens "
          f"in the references; batch run {batch_s:.1f} s")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
