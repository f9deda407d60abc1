"""Peak memory of one drafter training step at a Qwen3-0.6B shape (issue 8).

The drafter: hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary
151936, one layer, conditioned on 2 target layers (fc: 2048 -> 1024). The target's
embedding and head are random frozen layers and its features a random
[1, L, 2048] array, so no target model is needed. One step: sample anchors in a
random sequence of L tokens, loss and gradients over every anchor, an AdamW update.

    python benchmarks/train_memory.py --anchors 512 --length 2048 --anchor-chunk 64

prints one JSON line: the peak memory of the step (``mx.get_peak_memory()`` after a
reset, in GB), the memory held before it (weights, features, optimizer state) and
the step's wall time. Run against an older checkout (``PYTHONPATH=OLD_TREE``) the
script takes that code's path: one pass over all anchors (``"path": "one pass"``).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import dflash_mlx
from dflash_mlx import DFlashDrafter, DrafterArgs
from dflash_mlx.train import trainer
from dflash_mlx.train.blocks import position_weights, sample_anchors
from dflash_mlx.train.data import TrainSequence

VOCAB, HIDDEN = 151936, 1024


def drafter_at_qwen3_06b(block_size: int, dtype) -> DFlashDrafter:
    args = DrafterArgs(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=VOCAB, target_layer_ids=[1, 27],
                       mask_token_id=VOCAB - 1, block_size=block_size, num_target_layers=28)
    drafter = DFlashDrafter(args)
    drafter.set_dtype(dtype)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    embed.set_dtype(dtype)
    head.set_dtype(dtype)
    mx.eval(drafter.parameters(), embed.parameters(), head.parameters())
    return drafter.bind(embed, head)  # frozen: plain callables, as bound to a real target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchor-chunk", type=int, default=64, help="0: all anchors in one pass")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    B = a.block_size

    mx.random.seed(a.seed)
    drafter = drafter_at_qwen3_06b(B, dtype)
    rng = np.random.default_rng(a.seed)
    seq = TrainSequence(rng.integers(0, VOCAB - 1, size=a.length).astype(np.int32), 0)
    anchors = sample_anchors(rng, a.length, 0, B, a.anchors)
    features = mx.random.normal((1, a.length, 2 * HIDDEN)).astype(dtype)
    weights = mx.array(position_weights(B, 7.0))
    optimizer = optim.AdamW(learning_rate=1e-4)
    optimizer.init(drafter.trainable_parameters())
    mx.eval(features, optimizer.state)

    chunked = hasattr(trainer, "sequence_loss_and_grad")
    if chunked:
        fn = nn.value_and_grad(drafter, lambda *x: trainer.block_loss(drafter, *x[:5], weights, x[5]))
    else:  # the code before anchor chunks: block_loss over all anchors at once
        fn = nn.value_and_grad(drafter, lambda *x: trainer.block_loss(drafter, *x, weights))

    held = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if chunked:
        loss, grads = trainer.sequence_loss_and_grad(fn, features, seq, anchors, B, VOCAB - 1, a.anchor_chunk)
    else:
        loss, grads = fn(features, *trainer.make_batch(seq, B, VOCAB - 1, anchors))
    optimizer.update(drafter, grads)
    mx.eval(drafter.parameters(), optimizer.state, loss)
    seconds = time.perf_counter() - tic
    print(json.dumps({
        "path": f"chunks of {a.anchor_chunk or anchors.size}" if chunked else "one pass",
        "code": dflash_mlx.__file__, "anchors": int(anchors.size), "length": a.length, "block_size": B,
        "dtype": a.dtype, "held_gb": round(held / 1e9, 3), "peak_gb": round(mx.get_peak_memory() / 1e9, 3),
        "loss": round(loss.item(), 4), "seconds": round(seconds, 1),
    }))


if __name__ == "__main__":
    main()
