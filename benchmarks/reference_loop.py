#!/usr/bin/env python3
"""Our decode loop against the DFlash authors' reference MLX loop, same pair, same prompts.

The authors' loop is ``stream_generate`` in ``dflash/model_mlx.py`` of z-lab/dflash (their
April loop), or the same file of their PyPI package ``dflash`` 0.1.0 (a later version: sampling,
DFlash2 drafters, detokenized responses). It is not part of this repository: pass either file
with ``--reference`` (a checkout of z-lab/dflash, or the unpacked wheel). Their
loader downloads from the hub, so this script builds their ``DFlashDraftModel``
from the drafter folder's ``config.json`` and weights, and gives their loop its own
copy of the target (their loop wraps the target's layers in capture hooks).

One difference is bridged so both loops draft the same tokens: their hooks capture
every layer's output before the final norm, while Hugging Face's ``hidden_states``
(which training and this project use, DFLASH_SPEC.md section 3) give the last
layer's output after it. When ``target_layer_ids`` includes the last layer, the
hook of that layer applies the target's final norm (one RMSNorm of one row per
step). Their loop is otherwise run as published.

Per prompt, the two loops alternate (order flipped every repeat), after a warm-up;
decode time runs from the first token to the last. Reported: the median over
prompts of the per-prompt median ratio (their decode time / ours), tau of each,
and whether the tokens are the same.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/reference_loop.py --model OUT/target --draft-model OUT/drafter \\
        --reference /path/to/z-lab/dflash/dflash/model_mlx.py --block-sizes 16 auto
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as mlx_lm_load

from dflash_mlx import GenerationStats, load, stream_generate

ROOT = Path(__file__).resolve().parents[1]


def import_reference(path: Path):
    spec = importlib.util.spec_from_file_location("dflash_reference_model_mlx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_drafter(ref, folder: Path):
    """Their DFlashDraftModel, built from our folder's config and weights."""
    cfg = json.loads((folder / "config.json").read_text())
    rope_theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta")
    config = ref.DFlashConfig(
        hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=rope_theta,
        max_position_embeddings=cfg["max_position_embeddings"], block_size=cfg["block_size"],
        target_layer_ids=tuple(cfg["dflash_config"]["target_layer_ids"]), num_target_layers=cfg["num_target_layers"],
        mask_token_id=cfg["dflash_config"]["mask_token_id"], rope_scaling=cfg.get("rope_scaling"),
    )
    model = ref.DFlashDraftModel(config)
    weights = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def normed_last_layer(ref, model, layer_ids):
    """Their hooks, with the last layer's capture taken after the final norm (see the doc)."""
    ref._patch_model(model, layer_ids)
    layers = ref._get_layers(model)
    last = len(layers) - 1
    if last not in layer_ids:
        return
    hook = layers[last]
    norm = model.model.norm

    class NormedHook(ref._LayerHook):
        def __call__(self, *args, **kwargs):
            out = self._layer(*args, **kwargs)
            self._storage[self._idx] = norm(out)
            return out

    layers[last] = NormedHook(hook._layer, hook._idx, hook._storage)


def theirs(ref, model, draft, tokenizer, ids, max_tokens, block_size):
    tokens, accepted, first, last = [], [], None, None
    for r in ref.stream_generate(model, draft, tokenizer, mx.array(ids), block_size=block_size, max_tokens=max_tokens):
        last = time.perf_counter()
        first = first or last
        tokens += r.tokens
        if r.accepted:
            accepted.append(r.accepted)
    eos = set(tokenizer.eos_token_ids)
    tokens = [t for t in tokens if t not in eos]
    steps = accepted[1:]  # the first response is the prefill's token
    return tokens, last - first, (sum(steps) / len(steps) if steps else 0.0)


def ours(pair, ids, max_tokens, block_size):
    """Our ``stream_generate``: its text detokenized at every step, as theirs is."""
    stats = GenerationStats(block_size=pair.drafter.block_size)
    tokens, first, last = [], None, None
    for r in stream_generate(pair.target, pair.tokenizer, ids, pair.drafter, max_tokens=max_tokens,
                             block_size=block_size, stats=stats):
        last = time.perf_counter()
        first = first or last
        tokens += r.tokens
    return tokens, last - first, stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--reference", type=Path, required=True, help="the authors' dflash/model_mlx.py")
    p.add_argument("--prompts", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    p.add_argument("-n", "--num-prompts", type=int, default=10)
    p.add_argument("-m", "--max-tokens", type=int, default=256)
    p.add_argument("--block-sizes", nargs="+", default=["16", "auto"], help="ours; theirs always runs at 16")
    p.add_argument("--reference-block-size", type=int, default=None, help="theirs (default: the trained size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    ref = import_reference(args.reference)
    pair = load(args.model, args.draft_model)
    their_model, tokenizer = mlx_lm_load(args.model)
    draft = reference_drafter(ref, Path(args.draft_model))
    normed_last_layer(ref, their_model, list(draft.config.target_layer_ids))
    ref_block = args.reference_block_size or draft.config.block_size
    rows = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()][: args.num_prompts]
    prompts = [pair.tokenizer.encode(r) for r in rows]
    print("command:", shlex.join([sys.executable, *sys.argv]), file=sys.stderr)

    settings = [int(b) if b != "auto" else "auto" for b in args.block_sizes]
    for B in settings:  # warm-up
        ours(pair, prompts[0], 32, B)
    theirs(ref, their_model, draft, tokenizer, prompts[0], 32, ref_block)

    report = {"command": shlex.join(sys.argv), "reference": str(args.reference), "prompts": len(prompts),
              "max_tokens": args.max_tokens, "reference_block_size": ref_block, "rows": []}
    results = {B: {"ratio": [], "same": 0, "tau": [], "their_tau": []} for B in settings}
    for ids in prompts:
        for B in settings:
            per, mine_tokens, their_tokens = [], None, None
            for r in range(args.repeats):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                for who in order:
                    if who == 0:
                        mine_tokens, mine_s, stats = ours(pair, ids, args.max_tokens, B)
                    else:
                        their_tokens, their_s, their_tau = theirs(ref, their_model, draft, tokenizer, ids,
                                                                  args.max_tokens, ref_block)
                per.append(their_s / mine_s)
            res = results[B]
            res["ratio"].append(statistics.median(per))
            res["same"] += mine_tokens == their_tokens
            res["tau"].append(stats.tau)
            res["their_tau"].append(their_tau)
    print(f"| ours at --block-size | ours vs the reference at B={ref_block} | same tokens | tau ours | tau theirs |")
    print("|---|---:|---|---:|---:|")
    for B in settings:
        res = results[B]
        row = {"block_size": B, "speed_vs_reference": round(statistics.median(res["ratio"]), 3),
               "per_prompt": [round(x, 3) for x in res["ratio"]], "same": f"{res['same']}/{len(prompts)}",
               "tau": round(statistics.mean(res["tau"]), 2), "reference_tau": round(statistics.mean(res["their_tau"]), 2)}
        report["rows"].append(row)
        print(f"| {B} | {row['speed_vs_reference']:.2f}x | {row['same']} | {row['tau']:.2f} | {row['reference_tau']:.2f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
