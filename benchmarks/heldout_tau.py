#!/usr/bin/env python3
"""Held-out tau of one or more drafters on the same regenerated sequences, to compare drafters and the
checkpoints of a run: teacher forced at uniformly drawn anchors (the training table's figure) and along
greedy generation's own schedule ("as generated"), per block size, with position-1 accuracy. Each drafter
after the first is compared with the first on the same blocks: the difference of their teacher-forced tau and a
95% interval for it, drawn by resampling the sequences (paired bootstrap), so that a difference within what
the choice of held-out sequences moves is read as none.

The sequences are a `dflash data` folder made from prompts no drafter trained on, e.g. the target's replies to
64 held-out GSM8K questions, HumanEval tasks or MT-Bench turns kept in examples/smollm2-135m/heldout:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/heldout_tau.py \\
        --model OUT/smol --data examples/smollm2-135m/heldout/gsm8k --drafter examples/smollm2-135m/drafter \\
        --drafter OUT/drafter --block-sizes 16,4 --no-generation
"""

import argparse
import json
import sys

import numpy as np

from dflash_mlx import load
from dflash_mlx.drafter.checkpoint import DRAFTER_FILES
from dflash_mlx.errors import CheckpointError
from dflash_mlx.hub import resolve_model_path
from dflash_mlx.train.data import load_sequences
from dflash_mlx.train.evaluate import evaluate_block_sizes


def paired_difference(first, other, resamples: int = 2000, seed: int = 0) -> dict:
    """``{"difference", "low", "high"}``: teacher-forced tau of ``other`` less that of ``first``, and the 2.5th and
    97.5th percentiles of that difference over ``resamples`` draws of the sequences with replacement. ``first``
    and ``other``: ``[blocks, accepted drafts]`` per sequence (``evaluate_block_sizes``' ``per_sequence``), the
    same blocks in both. Raises ValueError where the two differ in their sequences or blocks."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if a.shape != b.shape or not np.array_equal(a[:, 0], b[:, 0]):
        raise ValueError("the two drafters were not scored on the same blocks")

    def tau(rows, pick):  # pick: [draws, sequences] indices
        return 1 + rows[pick, 1].sum(-1) / np.maximum(rows[pick, 0].sum(-1), 1)

    whole = np.arange(len(a))[None]
    pick = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    draws = tau(b, pick) - tau(a, pick)
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"difference": round(float(tau(b, whole)[0] - tau(a, whole)[0]), 4),
            "low": round(float(low), 4), "high": round(float(high), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target folder")
    ap.add_argument("--data", required=True, help="`dflash data` folder of held-out sequences")
    ap.add_argument("--drafter", action="append", required=True, help="drafter folder (repeatable)")
    ap.add_argument("--last", type=int, default=0,
                    help="only the folder's last N sequences (what `dflash train --held-out N` holds out)")
    ap.add_argument("--block-sizes", default="16,8,4")
    ap.add_argument("--no-generation", action="store_true",
                    help="teacher forced only (the 'as generated' figure drafts block by block: minutes here)")
    ap.add_argument("--json", action="store_true", help="one JSON object per drafter instead of a table")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    try:  # every drafter found before the first target pass, which takes minutes
        folders = [resolve_model_path(path, DRAFTER_FILES, what="drafter") for path in args.drafter]
    except CheckpointError as e:
        ap.error(str(e))
    seqs = load_sequences(args.data)[-args.last:] if args.last else load_sequences(args.data)
    print(f"{len(seqs)} sequences, {sum(s.tokens.size - s.response_start for s in seqs)} response tokens",
          file=sys.stderr)
    first, features = None, {}  # the target's features, computed once per sequence for all the drafters
    for path, folder in zip(args.drafter, folders):
        pair = load(args.model, str(folder))
        result = evaluate_block_sizes(pair.drafter, pair.target, seqs, sizes, chained=not args.no_generation,
                                      features=features)
        first = first or result
        against = {} if result is first else {
            b: paired_difference(first[b]["per_sequence"], r["per_sequence"]) for b, r in result.items()}
        if args.json:
            print(json.dumps({"drafter": path, **{str(b): r for b, r in result.items()},
                              **({"against_first": {str(b): d for b, d in against.items()}} if against else {})}))
            continue
        for b, r in result.items():
            generated = f" (as generated {r['tau_generation']:.2f})" if "tau_generation" in r else ""
            line = f"{path}  B={b}: tau {r['tau']:.3f}{generated}, acc1 {r['accuracy'][0]:.2f}"
            if b in against:
                d = against[b]
                line += f"; against the first {d['difference']:+.3f} (95% interval {d['low']:+.3f} to {d['high']:+.3f})"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
