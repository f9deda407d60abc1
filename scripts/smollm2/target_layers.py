#!/usr/bin/env python3
"""Two fresh drafters for a Llama target that differ only in how their layers start, to compare by training:

    python scripts/smollm2/target_layers.py --model OUT/smol --out OUT/init
    dflash train --model OUT/smol --data DATA --init OUT/init/fresh --out OUT/run-fresh ...
    dflash train --model OUT/smol --data DATA --init OUT/init/top --out OUT/run-top ...

``fresh`` is the drafter `dflash train` starts from without ``--init`` (``init_drafter``: random layers, seed
``--seed``); ``top`` is the same drafter with its N layers' weights copied from the target's last N layers
(attention projections, MLP, both norms; a quantized target's dequantized), Q and K rows reordered from the
target's interleaved rotary pairs (a GGUF file's, ``rope_traditional``) to the drafter's half split; its q_norm
and k_norm stay ones, and fc, hidden_norm and norm stay as in ``fresh``. Both are float32 folders ``--init`` reads.
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import dequantize_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts/smollm2"))

from cuda_train import unpermute  # noqa: E402

from dflash_mlx.cli.common import load_pair  # noqa: E402
from dflash_mlx.drafter.checkpoint import save_drafter  # noqa: E402
from dflash_mlx.errors import DFlashError, InputError  # noqa: E402
from dflash_mlx.train.start import init_drafter  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's mlx-lm folder (a Llama with rope_traditional)")
    ap.add_argument("--out", required=True, help="folder for fresh/ and top/")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--target-layer-ids", default="1,8,14,20,27", help="as the shipped SmolLM2 drafter reads")
    ap.add_argument("--mask-token-id", type=int, default=49151, help="as the shipped SmolLM2 drafter's")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if taken := [str(p) for p in (Path(a.out) / "fresh", Path(a.out) / "top") if p.exists()]:
        raise InputError(f"--out {a.out}: {' and '.join(taken)} already there; give a new folder")
    try:
        ids = [int(i) for i in a.target_layer_ids.split(",")]
    except ValueError:
        raise InputError(f"--target-layer-ids {a.target_layer_ids!r}: give layer numbers, e.g. 1,8,14") from None
    target = load_pair(a.model, None, defaults=False).target
    if not getattr(target.args, "rope_traditional", False):
        raise InputError(f"--model {a.model}: its Q and K are not in interleaved rotary order (rope_traditional)")
    if not 1 <= a.layers <= target.num_layers:
        raise InputError(f"--layers {a.layers}: give 1 to the target's {target.num_layers}")
    drafter = init_drafter(target, a.mask_token_id, a.layers, target_layer_ids=ids, seed=a.seed)
    save_drafter(drafter, Path(a.out) / "fresh")
    heads = {"q_proj": drafter.args.num_attention_heads, "k_proj": drafter.args.num_key_value_heads}
    for mine, theirs in zip(drafter.layers, map(dequantize_model, target.model.model.layers[-a.layers:])):
        for group in ("self_attn", "mlp"):
            for name, linear in getattr(theirs, group).children().items():
                if hasattr(linear, "weight"):
                    w = np.array(linear.weight)
                    getattr(mine, group)[name].weight = mx.array(unpermute(w, heads[name]) if name in heads else w)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(mine, norm).weight = getattr(theirs, norm).weight
    save_drafter(drafter, Path(a.out) / "top")
    print(f"{a.out}/fresh and {a.out}/top: {a.layers} layers, top/ from the target's last {a.layers}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DFlashError as e:
        sys.exit(f"error: {e}")
