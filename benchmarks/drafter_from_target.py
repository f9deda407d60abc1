#!/usr/bin/env python3
"""A 1-layer drafter whose layer starts as one of the target's own layers (the training recipe candidate
"drafter layers initialised from the target's top layers"), to pass to `dflash train --init`.

For a Llama target whose drafter shares its layer shapes (SmolLM2-135M: hidden 576, 9/3 heads of 64, MLP
1536): the layer's projections and norms copied, Q and K rows put back from llama.cpp's interleaved rotary
order (GGUF conversions run with `rope_traditional`) to the drafter's half-split order; `fc` picking the slot
of the last target_layer_id (the features that layer would read, near enough); `hidden_norm` the layer's input
norm; `norm` the target's final norm; the drafter's per-head `q_norm` / `k_norm` (Llama has none) set to the
mean RMS of the layer's queries and keys on a sample text, so that attention starts at the target's scale.

    python benchmarks/drafter_from_target.py --model OUT/smol --like examples/smollm2-135m/drafter \\
        --layer 29 --out OUT/init-L29
    dflash train --model OUT/smol --init OUT/init-L29 ...
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.base import create_attention_mask


def unpermute(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows of each head from the interleaved rotary pairs (2i, 2i+1) to the half-split pairs (i, i + hd/2)."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return w.reshape(heads, head_dim, -1)[:, order].reshape(heads * head_dim, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target folder (mlx-lm, Llama family)")
    ap.add_argument("--like", required=True, help="a drafter folder whose config.json (shape, layer ids) to keep")
    ap.add_argument("--layer", type=int, required=True, help="the target layer to copy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sample", default="README.md", help="text whose queries and keys set q_norm / k_norm")
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    config = json.loads((Path(args.like) / "config.json").read_text())
    H, hd = config["hidden_size"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    ids = config["dflash_config"]["target_layer_ids"]
    layer = model.model.layers[args.layer]
    h = model.model.embed_tokens(mx.array(tokenizer.encode(Path(args.sample).read_text()[:6000])[:1024])[None])
    mask = create_attention_mask(h, None)
    for earlier in model.model.layers[: args.layer]:
        h = earlier(h, mask, None)
    x = layer.input_layernorm(h)
    q = layer.self_attn.q_proj(x).reshape(-1, nh, hd)
    k = layer.self_attn.k_proj(x).reshape(-1, nkv, hd)
    q_rms, k_rms = (mx.sqrt((a * a).mean(-1)).mean().item() for a in (q, k))
    traditional = getattr(model.args, "rope_traditional", False)
    fix = (lambda w, n: mx.array(unpermute(np.array(w), n, hd))) if traditional else (lambda w, n: w)
    fc = np.zeros((H, len(ids) * H), np.float32)
    fc[:, (len(ids) - 1) * H:] = np.eye(H)
    attn, mlp = layer.self_attn, layer.mlp
    weights = {
        "fc.weight": mx.array(fc), "hidden_norm.weight": layer.input_layernorm.weight,
        "norm.weight": model.model.norm.weight,
        "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "layers.0.mlp.gate_proj.weight": mlp.gate_proj.weight, "layers.0.mlp.up_proj.weight": mlp.up_proj.weight,
        "layers.0.mlp.down_proj.weight": mlp.down_proj.weight,
        "layers.0.self_attn.q_proj.weight": fix(attn.q_proj.weight, nh),
        "layers.0.self_attn.k_proj.weight": fix(attn.k_proj.weight, nkv),
        "layers.0.self_attn.v_proj.weight": attn.v_proj.weight, "layers.0.self_attn.o_proj.weight": attn.o_proj.weight,
        "layers.0.self_attn.q_norm.weight": mx.full((hd,), q_rms), "layers.0.self_attn.k_norm.weight": mx.full((hd,), k_rms),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {n: w.astype(mx.float32) for n, w in weights.items()})
    shutil.copy(Path(args.like) / "config.json", out / "config.json")
    print(f"wrote {out}: target layer {args.layer}, query RMS {q_rms:.2f}, key RMS {k_rms:.2f}")


if __name__ == "__main__":
    main()
