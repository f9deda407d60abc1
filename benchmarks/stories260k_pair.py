#!/usr/bin/env python3
"""The trained stories260K pair: tau, exactness and speedup over plain mlx-lm.

On 20 hand-written story openings (scripts/data/story_openings.jsonl, none used in
training), greedy, 256 new tokens:
- tau (mean acceptance length) and the acceptance histogram, per block size;
- whether DFlash output equals mlx-lm's plain greedy output, prompt by prompt;
- wall-clock speedup: per prompt, mlx-lm ``stream_generate`` and DFlash alternate in
  this process (after a warm-up); the median over prompts of the per-prompt median
  ratio is reported, and the ratio of median times.

Run from the repository root, after ``scripts/train_stories260k.sh OUT``:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/stories260k_pair.py OUT --block-sizes 16 8 4
"""

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import GenerationStats, generate_step, load
from dflash_mlx.stats import PHASES, format_histogram

ROOT = Path(__file__).resolve().parents[1]


def mlx_lm_run(pair, ids, max_tokens):
    tic, tokens = time.perf_counter(), []
    for r in mlx_lm_stream_generate(pair.model, pair.tokenizer, mx.array(ids), max_tokens=max_tokens):
        if r.finish_reason != "stop":
            tokens.append(r.token)
    return tokens, time.perf_counter() - tic


def dflash_run(pair, ids, max_tokens, block_size, stats):
    tic, tokens = time.perf_counter(), []
    for step in generate_step(mx.array(ids), pair.target, pair.drafter, max_tokens=max_tokens,
                              block_size=block_size, stop_token_ids=pair.tokenizer.eos_token_ids, stats=stats):
        tokens += step.tokens
    return tokens, time.perf_counter() - tic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("pair", type=Path, help="OUT_DIR of scripts/train_stories260k.sh (target/ and drafter/)")
    p.add_argument("--drafter", type=Path, help="another drafter folder (default: PAIR/drafter)")
    p.add_argument("--prompts", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per prompt")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    pair = load(str(args.pair / "target"), str(args.drafter or args.pair / "drafter"))
    prompts = [pair.tokenizer.encode(json.loads(line)["prompt"]) for line in args.prompts.read_text().splitlines()]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    mlx_lm_run(pair, prompts[0], 32)
    dflash_run(pair, prompts[0], 32, args.block_sizes[0], GenerationStats(block_size=args.block_sizes[0]))

    report = {"command": shlex.join(sys.argv), "prompts": len(prompts), "max_tokens": args.max_tokens, "runs": {}}
    for B in args.block_sizes:
        stats = GenerationStats(block_size=B)
        ratios, t_ref, t_dflash, same = [], [], [], 0
        for ids in prompts:
            per_prompt = []
            for r in range(args.repeats):
                ref, tr = mlx_lm_run(pair, ids, args.max_tokens)
                out, td = dflash_run(pair, ids, args.max_tokens, B, stats if r == 0 else GenerationStats(block_size=B))
                per_prompt.append(tr / td)
                t_ref.append(tr)
                t_dflash.append(td)
            same += out == ref
            ratios.append(statistics.median(per_prompt))
        run = {
            "block_size": B, "tau": round(stats.tau, 3), "histogram": stats.histogram,
            "identical_outputs": f"{same}/{len(prompts)}",
            "speedup_median_of_ratios": round(statistics.median(ratios), 3),
            "speedup_ratio_of_medians": round(statistics.median(t_ref) / statistics.median(t_dflash), 3),
            "mlx_lm_tok_s": round(args.max_tokens / statistics.median(t_ref), 1),
            "dflash_tok_s": round(args.max_tokens / statistics.median(t_dflash), 1),
            "ms_per_step": {ph: round(1e3 * stats.phase_s[ph] / max(stats.steps, 1), 3) for ph in PHASES if ph != "prefill"},
        }
        report["runs"][B] = run
        print(f"B={B}: tau {run['tau']:.2f}, identical {run['identical_outputs']}, speedup "
              f"{run['speedup_median_of_ratios']:.2f}x (ratio of medians {run['speedup_ratio_of_medians']:.2f}x), "
              f"{run['dflash_tok_s']} vs {run['mlx_lm_tok_s']} tok/s, per step {run['ms_per_step']} ms")
        print(f"      histogram {format_histogram(stats.histogram)}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0 if all(r["identical_outputs"] == f"{len(prompts)}/{len(prompts)}" for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
