#!/usr/bin/env python3
"""``--block-size auto`` against a fixed block size, each generation a fresh `dflash generate`
process, paired: for every prompt and repeat the two run back to back (order alternated),
so a slow spell of a shared machine falls on both. No mlx-lm runs: the figure is the ratio
between the two settings, which needs more repeats than ``cli_speed.py`` can afford
(single processes here vary by a third from one to the next).

Reported: per prompt, auto's median decode speed over the fixed setting's; their median
over prompts; the ratio of the two settings' medians over prompts; the widths auto chose.
Every reply must equal the fixed setting's on the same prompt (both are the target's
greedy text).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 taskset -c 0 \\
        python benchmarks/auto_vs_fixed_cli.py --model OUT/target --draft-model OUT/drafter \\
        -n 10 --repeats 5 --fixed 8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from cli_speed import add_pair_args, prompts_from, run_dflash


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--fixed", default="8", help="the fixed --block-size auto is compared with")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    prompts = prompts_from(args.prompts, args.num_prompts)
    settings = ["auto", args.fixed]
    tps = {s: [[] for _ in prompts] for s in settings}
    widths: dict = {}
    print("command:", shlex.join([sys.executable, *sys.argv]), file=sys.stderr)
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            texts = {}
            for s in settings if (r + i) % 2 == 0 else settings[::-1]:
                res = run_dflash(args.model, args.draft_model, prompt, args.max_tokens, s)
                tps[s][i].append(res["tps"])
                texts[s] = res["text"]
                if s == "auto":
                    for k, n in res["widths"].items():
                        widths[k] = widths.get(k, 0) + n
            if texts["auto"] != texts[args.fixed]:
                raise SystemExit(f"prompt {i + 1}: auto's reply differs from --block-size {args.fixed}'s")
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    medians = {s: [statistics.median(x) for x in tps[s]] for s in settings}
    per_prompt = [a / b for a, b in zip(medians["auto"], medians[args.fixed])]
    report = {
        "command": shlex.join(sys.argv), "prompts": str(args.prompts), "repeats": args.repeats,
        "per_prompt_auto_over_fixed": [round(x, 3) for x in per_prompt],
        "median_of_per_prompt_ratios": round(statistics.median(per_prompt), 3),
        "ratio_of_medians": round(statistics.median(medians["auto"]) / statistics.median(medians[args.fixed]), 3),
        "median_tps": {s: round(statistics.median(medians[s]), 1) for s in settings},
        "auto_widths": dict(sorted(widths.items(), key=lambda kv: -kv[1])), "identical": f"{len(prompts)}/{len(prompts)}",
        "tps": tps,
    }
    print(f"auto / B={args.fixed}: median of per-prompt ratios {report['median_of_per_prompt_ratios']:.3f}, "
          f"ratio of medians {report['ratio_of_medians']:.3f}; per prompt {report['per_prompt_auto_over_fixed']}")
    print(f"auto's widths: {report['auto_widths']}; replies identical on {report['identical']} prompts")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
