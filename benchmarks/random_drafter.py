#!/usr/bin/env python3
"""Save an untrained (random) DFlash drafter that fits a target, for benchmarks.

A random drafter is almost never right, so tau is 1; with ``dflash bench
--simulate-acceptance A`` it still costs what a trained drafter of its shape costs.

    python benchmarks/random_drafter.py --model models/stories260K --out models/random-drafter \\
        --layers 1 --block-size 16

Width, vocabulary and attention shape follow the target's config.json; the target
layers read are spread evenly (the released drafters' rule).
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx

from dflash_mlx import DFlashDrafter, DrafterArgs, save_drafter
from dflash_mlx.drafter.config import default_target_layer_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target mlx-lm folder (its config.json is read)")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=0, help="an unused vocabulary row (0 = <unk> in stories260K)")
    p.add_argument("--target-layer-ids", default=None,
                   help="comma-separated target layers to read (default: spread evenly)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n_target = cfg["num_hidden_layers"]
    if args.target_layer_ids:
        layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    else:
        layer_ids = default_target_layer_ids(n_target, args.layers)
    mx.random.seed(args.seed)
    drafter = DFlashDrafter(DrafterArgs(
        hidden_size=hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        target_layer_ids=layer_ids, mask_token_id=args.mask_token_id, block_size=args.block_size,
        num_target_layers=n_target, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
    ))
    mx.eval(drafter.parameters())
    print(save_drafter(drafter, args.out))


if __name__ == "__main__":
    main()
