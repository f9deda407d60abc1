#!/usr/bin/env python3
"""Batched decoding in one process, no server: mlx-lm's ``BatchGenerator`` (plain) against
our batch (:class:`dflash_mlx.decode.batch.BatchDecoder`) at fixed widths, auto, and
without the drafter (``plain``), the same N prompts, greedy, ``--max-tokens`` each;
settings in turn, ``--repeats`` rounds; tokens/s from the first prefill to the last token,
median per setting. ``--warm`` keeps one decoder per setting across rounds (a server's
compiled shapes, and auto's timings and acceptance), after an untimed round.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        taskset -c 0 python benchmarks/batch_inprocess.py --model OUT/target --draft-model OUT/drafter
"""

import argparse
import statistics
import time

from mlx_lm.generate import BatchGenerator

from dflash_mlx import load
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.batch_width import BatchWidths
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.targets.fused import unfused

from story_openings import PROMPTS  # benchmarks/ is on the path when run as a script


def decoder(pair, width) -> BatchDecoder:
    """``width``: a fixed block size, ``auto``, or ``plain`` (our batch without the drafter)."""
    auto, plain = width == "auto", width == "plain"
    B = pair.drafter.block_size if auto else 1 if plain else int(width)
    return BatchDecoder(pair.target, None if plain else pair.drafter, B, BatchWidths(B) if auto else None)


def ours(pair, ids, width, max_tokens: int, dec=None) -> float:
    """Tokens/s of one round; ``dec``: a decoder kept from earlier rounds (a running
    server's: its compiled shapes and, for auto, its timings and acceptance), else a new one."""
    dec = dec if dec is not None else decoder(pair, width)
    auto = dec.widths is not None
    eos = tuple(pair.tokenizer.eos_token_ids)
    tic, n = time.perf_counter(), 0
    for k, p in enumerate(ids):
        n += len(dec.start(k, p, None, StopCondition(max_tokens, eos)).advance().tokens)
    while len(dec):
        n += sum(len(r.tokens) for r in dec.step())
    if auto:
        runs = {}
        for (w, _), k in dec.widths.runs.items():
            runs[w] = runs.get(w, 0) + k
        print(f"auto steps by width (this decoder so far): {dict(sorted(runs.items()))}", flush=True)
    return n / (time.perf_counter() - tic)


def mlx_lm_batch(pair, ids, max_tokens: int) -> float:
    with unfused(pair.target.model):  # mlx-lm's own modules, as mlx-lm loads the model
        gen = BatchGenerator(pair.target.model, max_tokens=max_tokens, stop_tokens=set(pair.tokenizer.eos_token_ids))
        tic, n = time.perf_counter(), 0
        gen.insert(ids, [max_tokens] * len(ids))
        while True:
            out = gen.next_generated()
            if not out:
                break
            n += len(out)
        gen.close()
    return n / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--settings", default="mlx_lm,plain,2,4,8,auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm", action="store_true",
                   help="one decoder per setting for every round, after an untimed round (as a server runs)")
    args = p.parse_args()
    pair = load(args.model, args.draft_model)
    ids = [pair.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.sequences)]
    settings = args.settings.split(",")
    figures = {s: [] for s in settings}
    kept = {s: decoder(pair, s) for s in settings if s != "mlx_lm"} if args.warm else {}
    for r in range(args.repeats + args.warm):
        for s in settings:
            if s == "mlx_lm":
                tps = mlx_lm_batch(pair, ids, args.max_tokens)
            else:
                tps = ours(pair, ids, s, args.max_tokens, kept.get(s))
            if r >= args.warm:
                figures[s].append(tps)
    print("| setting | tok/s (median) | all repeats |")
    print("|---|---:|---|")
    for s in settings:
        print(f"| {s} | {statistics.median(figures[s]):.0f} | {[round(f) for f in figures[s]]} |")


if __name__ == "__main__":
    main()
