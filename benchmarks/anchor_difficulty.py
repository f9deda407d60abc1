#!/usr/bin/env python3
"""Why tau along generation's schedule is below tau at uniform anchors (issue 24).

For every valid anchor of the held-out sequences, the teacher-forced block length L(a)
(accepted drafts + 1) of one drafter; then:

- the mean of L over all anchors (training's uniform estimate, "a" of tau_gap.py);
- its harmonic mean: what a walk that lands on each position with probability 1/L would
  measure (long blocks skip the positions they cover);
- the walk itself (a -> a + L(a) from the response start: "b" of tau_gap.py);
- the mean of L at positions right after a miss (a + L(a) for some anchor a) and elsewhere.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/anchor_difficulty.py /tmp/pair/s260 --drafter /tmp/pair/s260/drafter
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from dflash_mlx import load
from dflash_mlx.train.blocks import valid_anchors
from dflash_mlx.train.data import load_sequences
from dflash_mlx.train.trainer import chunk_batches, target_features


def block_lengths(pair, seq, block_size: int) -> dict:
    """{anchor: L} for every valid anchor of one sequence, 64 blocks per forward (as training)."""
    d = pair.drafter
    feats = target_features(pair.target, seq.tokens, d.target_layer_ids, mx.float32)
    anchors = valid_anchors(seq.tokens.size, seq.response_start, block_size).astype(np.int32)
    out = {}
    for context, (blocks, targets, anchors_mx, mask) in chunk_batches(seq, feats, anchors, block_size,
                                                                      d.args.mask_token_id, 64):
        right = np.array(d.block_logits(blocks, context, anchors_mx, mask).argmax(-1)) == np.array(targets)
        out.update(zip(np.array(anchors_mx).tolist(), (np.cumprod(right, axis=1).sum(1) + 1).tolist()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", help="folder with target/ and data-openings/ (scripts/train_stories260k.sh OUT)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=32)
    args = ap.parse_args(argv)
    pair = load(f"{args.pair}/target", args.drafter)
    every, walk, after, other = [], [], [], []
    for seq in load_sequences(f"{args.pair}/data-openings")[-args.held_out:]:
        L = block_lengths(pair, seq, args.block_size)
        every += L.values()
        a = min(L) if L else None
        while a in L:
            walk.append(L[a])
            a += L[a]
        after_miss = {a + n for a, n in L.items() if n < args.block_size}
        after += [n for a, n in L.items() if a in after_miss]
        other += [n for a, n in L.items() if a not in after_miss]
    every = np.array(every, dtype=float)
    print(json.dumps({"B": args.block_size, "uniform_mean": round(every.mean(), 4),
                      "harmonic_mean": round(1 / (1 / every).mean(), 4), "walk": round(float(np.mean(walk)), 4),
                      "after_a_miss": round(float(np.mean(after)), 4), "elsewhere": round(float(np.mean(other)), 4),
                      "share_after_a_miss": round(len(after) / every.size, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
