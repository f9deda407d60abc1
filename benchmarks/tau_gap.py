#!/usr/bin/env python3
"""One drafter's tau on the same sequences three ways (issue 24):

a. training's held-out estimate: teacher forced, blocks at uniformly drawn anchors
   (:func:`dflash_mlx.train.trainer.evaluate_block_sizes`, the training table's figure);
b. the engine's drafter, teacher forced along generation's own schedule (each block
   anchored where the last step's acceptance ended; :mod:`dflash_mlx.train.evaluate`);
c. real greedy generation from each sequence's prompt (the engine's stats: tokens per
   verify step, as ``dflash generate --json`` reports), and whether its output is the
   sequence's response.

Sequences: the last ``--held-out`` sequences of ``PAIR/data-openings`` (the training
run's held-out set), and the target's own greedy continuation (``--max-tokens``) of each
prompt of ``--openings`` (encoded as ``dflash generate -p`` encodes it).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 taskset -c 1 \\
        python benchmarks/tau_gap.py /tmp/pair/p1 --drafter /tmp/pair/p1/drafter --block-sizes 16 8
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import GenerationStats, generate_step, load
from dflash_mlx.prompt import encode_messages
from dflash_mlx.train.data import TrainSequence, load_sequences
from dflash_mlx.train.trainer import evaluate_block_sizes

ROOT = Path(__file__).resolve().parents[1]


def greedy_sequences(pair, prompts_file: Path, max_tokens: int):
    """Prompt + the target's own greedy continuation, per prompt of a JSON-lines file."""
    out = []
    for line in prompts_file.read_text().splitlines():
        ids = encode_messages(pair.tokenizer, [{"role": "user", "content": json.loads(line)["prompt"]}])
        reply = [t for s in generate_step(mx.array(ids), pair.target, None, max_tokens=max_tokens) for t in s.tokens]
        out.append(TrainSequence(np.array(ids + reply, dtype=np.int32), len(ids)))
    return out


def generated(pair, seqs, block_size: int):
    """(tau of real generation over all sequences, sequences whose output is the response)."""
    stats, same = GenerationStats(block_size=block_size), 0
    for s in seqs:
        P = s.response_start
        out = [t for st in generate_step(mx.array(s.tokens[:P]), pair.target, pair.drafter,
                                         max_tokens=s.tokens.size - P, block_size=block_size, stats=stats)
               for t in st.tokens]
        same += out == s.tokens[P:].tolist()
    return round(stats.tau, 4), same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", help="folder with target/ and data-openings/ (scripts/train_stories260k.sh OUT)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--openings", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    pair = load(f"{args.pair}/target", args.drafter)
    sets = {"held-out": load_sequences(f"{args.pair}/data-openings")[-args.held_out:],
            "openings": greedy_sequences(pair, args.openings, args.max_tokens)}
    rows = []
    for name, seqs in sets.items():
        ev = evaluate_block_sizes(pair.drafter, pair.target, seqs, args.block_sizes)
        for b in args.block_sizes:
            tau, same = generated(pair, seqs, b)
            rows.append({"sequences": name, "B": b, "a_uniform": ev[b]["tau"], "b_chained": ev[b]["tau_generation"],
                         "c_generated": tau, "identical": f"{same}/{len(seqs)}"})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
