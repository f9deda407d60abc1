#!/usr/bin/env python3
"""Where one batched plain decode step of a target goes on this CPU: what `dflash data` runs for every
token it regenerates. One process, float32, medians of repeats:

- the whole step: mlx-lm's model, N sequences, one new token each over a cache of L columns;
- its parts at the same shapes, per layer times the layers: the linear layers (q, k, v, o, gate, up,
  down) and the output head as matrix products, attention (``mx.fast.scaled_dot_product_attention``),
  SiLU, RMSNorm and RoPE;
- MLX's ``exp`` against NumPy's on the softmax's elements (MLX's CPU backend computes it element by
  element: it bounds softmax and SiLU).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/decode_step_parts.py --model OUT/smol --batch 32 --columns 300
"""

import argparse
import json
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from exp_cost import median_ms as median_of

median_ms = partial(median_of, n=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="mlx-lm folder (float32)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--columns", type=int, default=300, help="cache columns each new token attends over")
    args = ap.parse_args()
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(args.model)
    a = model.args
    n, cols, layers = args.batch, args.columns, a.num_hidden_layers
    heads, kv, hd = a.num_attention_heads, a.num_key_value_heads, a.hidden_size // a.num_attention_heads
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((n, cols), mx.int32), cache=cache))
    token = mx.zeros((n, 1), mx.int32)

    def step():
        mx.eval(model(token, cache=cache))
        for c in cache:
            c.offset -= 1

    out = {"batch": n, "columns": cols, "step_ms": median_ms(step)}
    x = mx.random.normal((n, a.hidden_size))
    shapes = [(a.hidden_size, (heads + 2 * kv) * hd), (heads * hd, a.hidden_size),
              (a.hidden_size, 2 * a.intermediate_size), (a.intermediate_size, a.hidden_size)]
    ws = [mx.random.normal((o, i)) for i, o in shapes]
    xs = [mx.random.normal((n, i)) for i, _ in shapes]
    head = mx.random.normal((a.vocab_size, a.hidden_size))
    q, k = mx.random.normal((n, heads, 1, hd)), mx.random.normal((n, kv, cols, hd))
    g, w = mx.random.normal((n, a.intermediate_size)), mx.ones((a.hidden_size,))
    s = mx.random.normal((n, heads, 1, cols))
    mx.eval(x, ws, xs, head, q, k, g, w, s)
    per_layer = {
        "linear layers": lambda: mx.eval([xi @ wi.T for xi, wi in zip(xs, ws)]),
        "attention": lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=hd ** -0.5)),
        "silu": lambda: mx.eval(nn.silu(g) * g),
        "rms_norm x2": lambda: mx.eval(mx.fast.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x + 1, w, 1e-5)),
        "rope q, k": lambda: mx.eval(mx.fast.rope(q, hd, traditional=True, base=1e4, scale=1.0, offset=cols),
                                     mx.fast.rope(q[:, :kv], hd, traditional=True, base=1e4, scale=1.0, offset=cols)),
    }
    out["parts_ms"] = {name: layers * median_ms(fn) for name, fn in per_layer.items()}
    out["parts_ms"]["output head"] = median_ms(lambda: mx.eval(x @ head.T))
    out["parts_ms"]["rest"] = out["step_ms"] - sum(out["parts_ms"].values())
    sn = np.array(s)
    out["exp_elements_per_s"] = {"mlx": s.size / median_ms(lambda: mx.eval(mx.exp(s))) * 1e3,
                                 "numpy": s.size / median_ms(lambda: np.exp(sn)) * 1e3}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
