#!/usr/bin/env python3
"""What rolling back a hybrid (Gated-DeltaNet) target costs, against its verify.

Builds a random ``qwen3_5`` target shaped like a real one (float32), prefills a
prompt, then per run and per acceptance ``a``: times one B-token verify forward
(the adapter's forward, head and features, evaluated), then the rollback of the
B-1-a rejected tokens (``target.rollback`` and the evaluation of every layer's
state). The rollback replays only the recurrence (see ``GatedDeltaCache``); for
comparison, the same state is also rebuilt by re-running each Gated-DeltaNet
layer's own mlx-lm module on the a+1 kept rows ("module replay", the design the
cache did not take). Medians over runs; ratios are over the verify of the same run.

    flock /tmp/dflash-bench.lock env \\
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/gdn_rollback.py --shape 0.8b --runs 7
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import make_adapter
from dflash_mlx.prompt_cache.gated_delta import GatedDeltaCache

# Gated-DeltaNet layers: 16 key heads x 128 (as published for Qwen3.5-0.8B); the other
# sizes are assumptions of this benchmark, close to the released small Qwen3.5 models.
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16),
    "4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32),
}


def build(shape: str, layers: int, vocab: int):
    cfg = dict(SHAPES[shape], model_type="qwen3_5", vocab_size=vocab, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               tie_word_embeddings=True, rms_norm_eps=1e-6)
    if layers:
        cfg["num_hidden_layers"] = layers
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model, make_adapter(model), cfg


def timed(fn):
    tic = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - tic)


def one_run(target, prompt, block, a, capture):
    """(verify ms, rollback ms, module-replay ms) for one verify accepting ``a`` drafts."""
    B = block.shape[1]
    cache = target.make_cache(B)
    target(prompt, cache)
    mx.eval([c.state for c in cache])
    gdn = [i for i, c in enumerate(cache) if isinstance(c, GatedDeltaCache)]
    before = {i: list(cache[i].cache) for i in gdn}

    inputs = {}

    def verify():
        h = target.embed(block)
        outs = []
        for i, out in enumerate(target.run_layers(block, h, cache)):
            inputs[i] = h if i == 0 else outs[-1]
            outs.append(out)
        logits = target.lm_head(target.inner.norm(outs[-1]))
        features = mx.concatenate([outs[i] for i in capture], axis=-1)
        mx.eval(logits, features, [c.state for c in cache])

    def rollback():
        target.rollback(cache, B - 1 - a)
        mx.eval([c.state for c in cache])

    def module_replay():
        states = []
        for i in gdn:
            layer, tmp = target.layers[i], ArraysCache(2)
            tmp.cache = list(before[i])
            layer.linear_attn(layer.input_layernorm(inputs[i][:, : a + 1]), None, tmp)
            states += tmp.cache
        mx.eval(states)

    v = timed(verify)
    r = timed(rollback)
    m = timed(module_replay)
    return v, r, m


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.8b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (memory)")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the verify")
    ap.add_argument("--accepted", type=int, nargs="+", default=[0, 3, 7, 14])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()

    model, target, cfg = build(args.shape, args.layers, args.vocab)
    B = args.block_size
    prompt = mx.array([[(37 * i + 11) % args.vocab for i in range(args.prompt)]])
    block = mx.array([[(101 * i + 7) % args.vocab for i in range(B)]])
    capture = [1, target.num_layers // 2, target.num_layers - 1]
    one_run(target, prompt, block, 0, capture)  # warm-up
    n_gdn = sum(layer.is_linear for layer in target.layers)
    print(f"qwen3_5 {args.shape}-shaped, {cfg['num_hidden_layers']} layers ({n_gdn} Gated-DeltaNet), "
          f"hidden {cfg['hidden_size']}, vocab {args.vocab}, float32, B={B}, prompt {args.prompt}, "
          f"{args.runs} runs, median")
    print("| accepted a | rolled back | verify ms | rollback ms | rollback / verify | module replay ms "
          "| module replay / verify |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for a in args.accepted:
        runs = [one_run(target, prompt, block, a, capture) for _ in range(args.runs)]
        v, r, m = (statistics.median(x) for x in zip(*runs))
        ratio_r = statistics.median(x[1] / x[0] for x in runs)
        ratio_m = statistics.median(x[2] / x[0] for x in runs)
        print(f"| {a} | {B - 1 - a} | {v:.1f} | {r:.2f} | {ratio_r:.3f} | {m:.1f} | {ratio_m:.3f} |")


if __name__ == "__main__":
    main()
