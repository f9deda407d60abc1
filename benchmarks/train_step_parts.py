#!/usr/bin/env python3
"""Where a training step of a real drafter goes: ``dflash train``'s step on SmolLM2-135M-Instruct (or any
pair) with the flags of the runs in docs/benchmarks.md, timed whole and in parts at the same shapes.

Builds the ``Trainer`` that ``dflash train --init DRAFTER --data DATA ...`` builds (features read from
DATA/features, as ``dflash data --target-layer-ids`` kept them), runs ``--warm`` steps, times ``--steps``
more, then times each part of one micro-step alone, median of ``--repeats``: reading the features, drawing
the sampled softmax's columns, the forward loss, the loss and its gradients, the optimizer's update.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/train_step_parts.py --model OUT/smol --init DRAFTER --data OUT/data-chat
"""

import argparse
import json
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from dflash_mlx import load
from dflash_mlx.train.data import load_sequences
from dflash_mlx.train.features import FOLDER
from dflash_mlx.train.loss import chunk_batches
from dflash_mlx.train.blocks import sample_anchors
from dflash_mlx.train.trainer import TrainConfig, Trainer
from dflash_mlx.train.start import warm_start
from exp_cost import median_ms  # benchmarks/ is on the path when run as a script


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--init", required=True, help="the drafter to train further (dflash train --init)")
    ap.add_argument("--data", required=True, help="a dflash data folder with its features/")
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--anchor-chunk", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="the block size the parts are timed at")
    ap.add_argument("--loss-vocab", default="data", choices=["data", "full"])
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    pair = load(args.model)
    target = pair.target
    seqs = load_sequences(args.data)
    drafter = warm_start(args.init, target)
    config = TrainConfig(steps=args.warm + args.steps, anchors=args.anchors, anchor_chunk=args.anchor_chunk,
                         lr=2e-4, warmup=0.02, block_sizes=[4, 8, 16], miss_anchors=0.5, loss_vocab=args.loss_vocab)
    out = {"model": args.model, "init": args.init, "data": args.data, "sequences": len(seqs),
           "anchors": args.anchors, "anchor_chunk": args.anchor_chunk, "loss_vocab": args.loss_vocab}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(drafter, target, seqs, config, tmp, feature_stores=[f"{args.data}/{FOLDER}"])
        steps = trainer.run()
        for _ in range(args.warm):
            next(steps)
        tic = time.perf_counter()
        for _ in range(args.steps):
            next(steps)
        out["step_s"] = (time.perf_counter() - tic) / args.steps

        B, rng = args.block_size, np.random.default_rng(0)
        index = int(np.argsort([s.tokens.size for s in trainer.sequences])[len(trainer.sequences) // 2])
        seq = trainer.sequences[index]  # the median length
        anchors = sample_anchors(rng, seq.tokens.size, seq.response_start, B, args.anchors)
        feats, _ = trainer.features.get(seq, trainer.dtype)
        context, batch = next(iter(chunk_batches(seq, feats, anchors, B, drafter.args.mask_token_id, args.anchor_chunk)))
        out.update(sequence_tokens=int(seq.tokens.size), block_size=B,
                   columns=int(trainer.vocab.columns.size) if trainer.vocab else target.vocab_size)

        def features():
            mx.eval(trainer.features.get(seq, trainer.dtype)[0])

        def draw():
            trainer.vocab.draw(rng)

        def forward():
            mx.eval(trainer._loss(context, *batch, anchors.size))

        def hidden_only():
            mx.eval(drafter.block_hidden(batch[0], context, batch[2], batch[3]))

        def loss_and_grad():
            mx.eval(trainer._loss_and_grad(context, *batch, anchors.size))

        import mlx.nn as nn
        from dflash_mlx.kernels import fast_softmax

        hidden = drafter.block_hidden(batch[0], context, batch[2], batch[3])
        mx.eval(hidden)
        targets = trainer.vocab.index[batch[1]] if trainer.vocab else batch[1]

        def head_ce(h):
            logits = h @ trainer.vocab.head.T + trainer.vocab.shift if trainer.vocab else target.lm_head(h)
            return fast_softmax.cross_entropy(logits.astype(mx.float32), targets).sum()

        def head_and_grad():
            mx.eval(mx.value_and_grad(head_ce)(hidden))

        drafter_grad = nn.value_and_grad(drafter, lambda *a: drafter.block_hidden(*a).sum())

        def drafter_and_grad():
            mx.eval(drafter_grad(batch[0], context, batch[2], batch[3]))

        _, grads = trainer._loss_and_grad(context, *batch, anchors.size)
        grads = tree_map(lambda g: g * 0.0, grads)  # a zero update: timing only

        def update():
            trainer.optimizer.update(drafter, grads)
            mx.eval(drafter.parameters(), trainer.optimizer.state)

        parts = {"features": features, "drafter forward to hidden": hidden_only, "forward loss": forward,
                 "loss and gradients": loss_and_grad, "  of which head and cross-entropy": head_and_grad,
                 "  of which the drafter to hidden": drafter_and_grad, "optimizer update": update}
        if trainer.vocab is not None:
            parts["draw columns"] = draw
        out["parts_s"] = {name: median_ms(fn, args.repeats) / 1000 for name, fn in parts.items()}
    print(f"step: {out['step_s'] * 1000:.0f} ms ({args.anchors} anchors, block sizes 4/8/16, {len(seqs)} sequences)")
    for name, s in out["parts_s"].items():
        print(f"  {name:28s} {s * 1000:8.1f} ms  (B={B}, {out['sequence_tokens']} tokens, {out['columns']} columns)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
