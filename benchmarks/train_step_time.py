#!/usr/bin/env python3
"""Milliseconds per training step of the stories260K recipe, with --miss-anchors' store
empty or filled (issue 24): does drawing anchors after misses cost time?

Trains a copy of PAIR/drafter for 40 steps with the script's settings (64 anchors, two
sequences per step, block sizes 4, 8 and 16) on PAIR's data and cached features, and
times the last 30. ``store`` fills every sequence's positions after misses first (60 drawn
per sequence), so every step draws half its anchors from them. Run each mode in a fresh
process, alternated, and compare medians.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        taskset -c 1 python benchmarks/train_step_time.py /tmp/pair/s260 empty
"""

import argparse
import sys
import tempfile
import time

import numpy as np

from dflash_mlx import load
from dflash_mlx.drafter.checkpoint import load_drafter
from dflash_mlx.pair.loading import bind_drafter
from dflash_mlx.train.data import load_sequences
from dflash_mlx.train.trainer import TrainConfig, Trainer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", help="scripts/train_stories260k.sh OUT (target/, data-*/, drafter/features/)")
    ap.add_argument("mode", choices=["empty", "store"])
    args = ap.parse_args(argv)
    O = args.pair
    pair = load(f"{O}/target")
    seqs = (load_sequences(f"{O}/data-prefix") + load_sequences(f"{O}/data-openings"))[:-32]  # the script's held-out 32
    drafter = bind_drafter(load_drafter(f"{O}/drafter"), pair.target, f"{O}/drafter")
    config = TrainConfig(steps=40, anchors=64, grad_accum=2, lr=1e-4, block_sizes=[4, 8, 16], miss_anchors=0.5)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(drafter, pair.target, seqs, config, out, feature_cache=f"{O}/drafter/features")
        if args.mode == "store":
            rng = np.random.default_rng(0)
            for i, s in enumerate(trainer.sequences):
                trainer.after_misses[i] = np.unique(rng.integers(s.response_start, s.tokens.size, 60))
        steps = trainer.run()
        for _ in range(10):  # features read, shapes compiled
            next(steps)
        tic = time.perf_counter()
        for _ in range(30):
            next(steps)
    print(f"{args.mode}: {(time.perf_counter() - tic) / 30 * 1000:.1f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
