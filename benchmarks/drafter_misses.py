#!/usr/bin/env python3
"""Where a drafter's first draft misses: position-1 accuracy (teacher forced at uniformly drawn anchors, as
``benchmarks/heldout_tau.py``) by the kind of token it had to draft (holding a digit; only spaces and
punctuation; a word) and by the target's own top-1 probability of that token. Misses where the target was
sure (top-1 above 0.9) are the drafter's to win; misses where it was not may be beyond any drafter.

A drafter with a confidence head (DSpark) is also scored on what a confidence-scheduled verify would need: per
bin of the head's confidence (sigmoid), how often that row's draft is right, and, cutting each block where
the product of the confidences so far falls below a threshold, the drafts verified and accepted per block.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/drafter_misses.py \\
        --model OUT/smol --data OUT/data-heldout --drafter examples/smollm2-135m/drafter
"""

import argparse
import json

import mlx.core as mx
import numpy as np

from dflash_mlx import load
from dflash_mlx.train.blocks import previous_tokens, sample_anchors
from dflash_mlx.train.data import load_sequences
from dflash_mlx.train.loss import chunk_batches, target_outputs

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def kind(text: str) -> str:
    if any(c.isdigit() for c in text):
        return "digit"
    return "word" if any(c.isalpha() for c in text) else "space or punctuation"


def confidence_report(scored: list) -> dict:
    """Calibration of a confidence head (per bin: the share of rows, and of their drafts right) and the cut rule
    (cut a block where the running product of confidences falls below t: drafts verified and accepted per block,
    greedy, against verifying all) against a fixed number of drafts k (``fixed``: drafts accepted per block)."""
    conf = np.stack([c for c, _ in scored])
    right = np.stack([r for _, r in scored])
    out = {"by_confidence": {}, "cut": {}}
    for lo, hi in zip(BINS, BINS[1:]):
        part = (conf >= lo) & ((conf < hi) | (hi == 1.0))
        if part.any():
            out["by_confidence"][f"{lo:.1f}-{hi:.1f}"] = {"share": round(float(part.mean()), 3),
                                                        "right": round(float(right[part].mean()), 3)}
    accepted_all = np.cumprod(right, axis=1).sum(axis=1)
    for t in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
        verified = (np.cumprod(conf, axis=1) >= t).sum(axis=1) if t else np.full(len(conf), conf.shape[1])
        accepted = np.minimum(accepted_all, verified)
        out["cut"][str(t)] = {"verified": round(float(verified.mean()), 2), "accepted": round(float(accepted.mean()), 2)}
    out["fixed"] = {str(k): round(float(np.minimum(accepted_all, k).mean()), 2) for k in (1, 2, 3, 4, 5, 7, 15)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target folder")
    ap.add_argument("--data", required=True, help="`dflash data` folder of held-out sequences")
    ap.add_argument("--drafter", required=True, help="drafter folder")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=256, help="anchors per sequence (as heldout_tau.py)")
    ap.add_argument("--last", type=int, help="only the folder's last N sequences (what `dflash train --held-out N` holds out)")
    args = ap.parse_args(argv)
    pair, B = load(args.model, args.drafter), args.block_size
    rows = []  # (kind, target's top-1 probability, drafter right)
    scored = []  # with a confidence head: per block (confidences [B-1], drafts right [B-1])
    sequences = load_sequences(args.data)
    for i, seq in enumerate(sequences[-args.last:] if args.last else sequences):
        anchors = sample_anchors(np.random.default_rng([0, 7919, i]), seq.tokens.size, seq.response_start, B,
                                 args.anchors)
        feats, hidden = target_outputs(pair.target, seq.tokens, pair.drafter.target_layer_ids, mx.float32)
        top = mx.softmax(pair.target.lm_head(hidden).astype(mx.float32), axis=-1)[0].max(axis=-1)  # [L]
        for context, (blocks, targets, at, mask) in chunk_batches(seq, feats, anchors, B,
                                                                  pair.drafter.args.mask_token_id, 64):
            hidden = pair.drafter.block_hidden(blocks, context, at, mask)
            previous = previous_tokens(blocks, targets)
            logits = pair.drafter.block_logits(blocks, context, at, mask, previous, hidden)
            drafts = np.array(mx.argmax(logits, -1))
            first = drafts[:, 0]
            if "confidence_head" in pair.drafter:
                conf = np.array(mx.sigmoid(pair.drafter.confidence(hidden, previous)))
                scored += zip(conf, drafts == np.array(targets))
            want, p = np.array(targets)[:, 0], np.array(top[at])  # row 1 drafts anchor + 1: the target at anchor
            rows += [(kind(pair.tokenizer.decode([int(w)])), float(q), bool(f == w)) for f, w, q in zip(first, want, p)]
    misses = sum(not r for _, _, r in rows)
    out = {"drafter": args.drafter, "blocks": len(rows), "acc1": round(sum(r for *_, r in rows) / len(rows), 3),
           "by_kind": {}, "by_target_top1": {}}
    for name in sorted({k for k, _, _ in rows}):
        part = [r for k, _, r in rows if k == name]
        out["by_kind"][name] = {"share": round(len(part) / len(rows), 3), "acc1": round(sum(part) / len(part), 3),
                                "share_of_misses": round((len(part) - sum(part)) / max(misses, 1), 3)}
    for lo, hi in zip(BINS, BINS[1:]):
        part = [r for _, q, r in rows if lo <= q < hi or (hi == 1.0 and q == 1.0)]
        if part:
            out["by_target_top1"][f"{lo:.1f}-{hi:.1f}"] = {"share": round(len(part) / len(rows), 3),
                                                         "acc1": round(sum(part) / len(part), 3)}
    if scored:
        out["confidence"] = confidence_report(scored)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
