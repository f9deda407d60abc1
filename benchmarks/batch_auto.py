#!/usr/bin/env python3
"""Auto against plain decoding and fixed block sizes in a batch: ``-n`` prompts (through the chat
template) decoded together by one :class:`BatchDecoder`, as ``dflash serve --max-batch N`` steps them,
each setting in turn for ``--repeats`` rounds (the order reversed every other round). Prints each
setting's tokens/s (median over rounds), its ratio to plain decoding in the same rounds (the drafter's
context features captured, as auto captures them; a decoder without a drafter would not), and the
steps it ran at each width. Greedy; every setting's tokens are compared with plain's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/batch_auto.py --model OUT/smol --draft-model examples/smollm2-135m/drafter \\
        --prompts OUT/prompts/gsm8k_heldout.jsonl -n 8 --max-tokens 48 --settings plain auto 2 4
"""

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from cli_speed import prompts_from

from dflash_mlx import load
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.decode.width import make_chooser


def decode(pair, prompts, setting: str, max_tokens: int):
    """One batch of every prompt at ``setting`` (``plain``: chains never planned): (tokens/s, tokens per
    prompt, steps per width)."""
    drafter = pair.drafter
    width = {"plain": 1, "auto": "auto"}.get(setting) or int(setting)  # a fixed width of 1: plain steps
    chooser = make_chooser(pair.target, drafter, width, None)
    decoder = BatchDecoder(pair.target, drafter, drafter.block_size, chooser)
    joining = [decoder.start(i, ids, None, StopCondition(max_tokens, tuple(pair.tokenizer.eos_token_ids)))
               for i, ids in enumerate(prompts)]
    tokens = {i: [] for i in range(len(prompts))}
    for j in joining:
        while (first := j.advance()) is None:
            pass
        tokens[j.key] += first.tokens
    widths, tic = Counter(), time.perf_counter()
    while len(decoder):
        keys = [s.key for s in decoder.sequences]
        results = decoder.step()
        widths[results[0].width] += 1
        for key, r in zip(keys, results):
            tokens[key] += r.tokens
    seconds = time.perf_counter() - tic
    return sum(map(len, tokens.values())) / seconds, tokens, widths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of prompts or any dataset dflash bench reads")
    p.add_argument("-n", "--num-prompts", type=int, default=8, help="the batch")
    p.add_argument("-m", "--max-tokens", type=int, default=48)
    p.add_argument("--settings", nargs="+", default=["plain", "auto", "2", "4"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    pair = load(args.model, args.draft_model)
    template = pair.tokenizer.apply_chat_template
    prompts = [template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in prompts_from(args.prompts, args.num_prompts)]
    settings = ["plain"] + [s for s in args.settings if s != "plain"]
    decode(pair, prompts, "plain", 8)  # warm-up: the batch's shapes traced once
    rates, widths, same = {s: [] for s in settings}, {s: Counter() for s in settings}, {s: True for s in settings}
    for r in range(args.repeats):
        runs = {}
        for s in settings if r % 2 == 0 else settings[::-1]:
            rate, tokens, steps = decode(pair, prompts, s, args.max_tokens)
            rates[s].append(rate)
            widths[s] += steps
            runs[s] = tokens
        for s in settings:
            same[s] &= runs[s] == runs["plain"]
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{s} {rates[s][-1]:.1f}" for s in settings),
              file=sys.stderr)
    base = statistics.median(rates["plain"])
    print(f"| setting ({len(prompts)} in one batch) | tokens/s | vs plain | steps by width | same tokens as plain |")
    print("|---|---:|---:|---|---|")
    for s in settings:
        rate = statistics.median(rates[s])
        steps = ", ".join(f"{w}: {c}" for w, c in sorted(widths[s].items()))
        print(f"| {s} | {rate:.1f} | {rate / base:.2f}x | {steps} | {'yes' if same[s] else 'NO'} |")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
