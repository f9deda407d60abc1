#!/usr/bin/env python3
"""Speed as users run it: each generation a fresh `dflash generate` process, against a
fresh `mlx_lm generate` process on the same prompt, in the same run.

For every prompt, every repeat runs plain mlx-lm and each `--block-size` setting once,
in an order rotated per prompt and repeat. Reported per setting, as medians over
prompts of the per-prompt median ratio to mlx-lm:

- decode speed: the `Generation: ... tokens-per-sec` figure each tool prints
  (first token to last, as mlx-lm defines it);
- process time: wall seconds of the whole command, start-up, loading and any
  calibration included (what a script that calls the CLI per prompt waits);
- with the setting ``plain`` (`dflash generate` without a drafter) in the run, each setting's
  decode speed against it too, as the median over prompts of the per-prompt median ratio;
- each setting against the best fixed block size (the numeric setting of the highest median speed), the same way:
  a ratio of two medians over prompts would compare different prompts;
- two drafters in one run: a setting ending in ``@PATH`` uses the drafter at PATH (``--settings 4 4@OTHER``);
- tau, the widths chosen (and how many steps were probes), and whether the text equals mlx-lm's on every prompt (a
  reply that dflash stops at the target's context, where mlx-lm goes on, counts as
  equal when it is the start of mlx-lm's).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/cli_speed.py --model OUT/target --draft-model OUT/drafter \\
        --prompts scripts/data/story_openings.jsonl -n 10 --settings auto 4 8 16 --out docs/bench/cli-speed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dflash_mlx.cli.bench_tables import cell

ROOT = Path(__file__).resolve().parents[1]


def prompts_from(path: Path, n: int) -> list:
    """Prompt texts: rows of ``prompt`` (JSONL) or any dataset ``dflash bench`` reads."""
    sys.path.insert(0, str(ROOT))
    from dflash_mlx.bench.datasets import load_dataset

    return [s.turns[0] for s in load_dataset(str(path), n)[1]]


def run_mlx_lm(model: str, prompt: str, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--temp", "0"]
    tic = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if r.returncode:
        raise RuntimeError(f"mlx_lm generate failed: {r.stderr[-2000:]}")
    text = r.stdout.split("==========\n", 2)[1].rsplit("\n==========", 1)[0]
    text = text[:-1] if text.endswith("\n") else text  # mlx-lm prints a newline after the text
    tps = float(re.search(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", r.stdout).group(1))
    return {"text": text, "tps": tps, "wall": wall}


def run_dflash(model: str, draft: str, prompt: str, max_tokens: int, setting: str) -> dict:
    """``setting``: a --block-size (``auto``, ``16``), ``plain`` (no drafter, no prompt lookup) or ``lookup``
    (no drafter, prompt lookup); ``:off`` after a block size turns prompt lookup off; ``@PATH`` at the end drafts
    with the drafter at PATH instead of ``draft`` (two drafters in one run: ``16 16@OTHER``)."""
    setting, _, other = setting.partition("@")
    draft = other or draft
    block, _, lookup = setting.partition(":")
    pair = [] if block in ("plain", "lookup") else ["--draft-model", draft, "--block-size", block]
    pair += ["--prompt-lookup", "off" if block == "plain" or lookup == "off" else "auto"]
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "generate", "--model", model, *pair,
           "-p", prompt, "-m", str(max_tokens), "--json", "--quiet"]
    tic = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if r.returncode:
        raise RuntimeError(f"dflash generate failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    capped = "tokens will be generated" in r.stderr  # the prompt and reply would pass the target's context
    return {"text": out["text"], "tps": out["generation_tps"], "wall": wall, "tau": out["tau"], "capped": capped,
            "widths": out.get("widths", {}), "probe_steps": out.get("probe_steps", 0),
            "copied": out.get("prompt_lookup", {}).get("drafted", 0)}


def median_or_none(values) -> float | None:
    """The median of the values that are not None (tau is None for a run with no verify step)."""
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 2) if kept else None


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """The pair, prompts and reply length (shared with ``auto_vs_fixed_cli.py``)."""
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    p.add_argument("-n", "--num-prompts", type=int, default=10)
    p.add_argument("-m", "--max-tokens", type=int, default=256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--settings", nargs="+", default=["plain", "auto", "4", "8", "16"],
                   help="--block-size values (auto:off: prompt lookup off; 16@PATH: with the drafter at PATH), plain "
                   "(no drafter nor lookup), lookup")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    prompts = prompts_from(args.prompts, args.num_prompts)
    engines = ["mlx-lm"] + args.settings
    runs = {e: [[] for _ in prompts] for e in engines}
    print("command:", shlex.join([sys.executable, *sys.argv]), file=sys.stderr)
    for i, prompt in enumerate(prompts):
        for r in range(args.repeats):
            k = (i * args.repeats + r) % len(engines)
            for e in engines[k:] + engines[:k]:
                res = (run_mlx_lm(args.model, prompt, args.max_tokens) if e == "mlx-lm"
                       else run_dflash(args.model, args.draft_model, prompt, args.max_tokens, e))
                runs[e][i].append(res)
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)

    def per_prompt_ratio(e, key, baseline="mlx-lm"):
        out = []
        for mine, base in zip(runs[e], runs[baseline]):
            ours = statistics.median(x[key] for x in mine)
            ref = statistics.median(x[key] for x in base)
            out.append(ours / ref if key == "tps" else ref / ours)
        return out

    fixed = [e for e in args.settings if e.split("@")[0].isdigit()]  # the best fixed block size: by median speed
    best = max(fixed, key=lambda e: statistics.median(per_prompt_ratio(e, "tps")), default=None)
    rows = []
    for e in args.settings:
        speed, wall = per_prompt_ratio(e, "tps"), per_prompt_ratio(e, "wall")
        # mlx-lm decodes past the target's context (max_position_embeddings); dflash stops there: a
        # reply cut by the context is identical when it is the start of mlx-lm's.
        same = sum(all(x["text"] == base[0]["text"] or (x["capped"] and base[0]["text"].startswith(x["text"]))
                       for x in mine) for mine, base in zip(runs[e], runs["mlx-lm"]))
        capped = sum(any(x["capped"] for x in mine) for mine in runs[e])
        widths = {}
        for mine in runs[e]:
            for x in mine:
                for k, n in x["widths"].items():
                    widths[k] = widths.get(k, 0) + n
        rows.append({
            "block_size": e, "speed_vs_mlx_lm": round(statistics.median(speed), 3),
            "speed_vs_plain": (round(statistics.median(per_prompt_ratio(e, "tps", "plain")), 3)
                               if "plain" in runs else None),
            "speed_vs_lookup_off": (round(statistics.median(per_prompt_ratio(e, "tps", f"{e}:off")), 3)
                                    if f"{e}:off" in runs else None),
            "speed_vs_best_fixed": round(statistics.median(per_prompt_ratio(e, "tps", best)), 3) if best else None,
            "copied": sum(x["copied"] for mine in runs[e] for x in mine),
            "probe_steps": sum(x["probe_steps"] for mine in runs[e] for x in mine),
            "process_time_ratio": round(statistics.median(wall), 3),
            "per_prompt_speed": [round(x, 3) for x in speed],
            "tau": median_or_none([x["tau"] for mine in runs[e] for x in mine]),
            "identical": f"{same}/{len(prompts)}", "capped_by_context": capped, "widths": dict(sorted(widths.items(), key=lambda kv: -kv[1])),
        })
    base_tps = statistics.median(x["tps"] for mine in runs["mlx-lm"] for x in mine)
    print(f"\nmlx-lm: {base_tps:.1f} tokens/s (median)")
    print(f"| --block-size | speed vs mlx-lm | vs plain | vs lookup off | vs best fixed{f' ({best})' if best else ''} "
          "| process time vs mlx-lm | tau | identical | widths |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        top = ", ".join(f"{k} x{n}" for k, n in list(row["widths"].items())[:4])
        top += f" ({row['probe_steps']} probes)" if row["probe_steps"] else ""
        plain, off, vs_best = (cell(row[k], "{:.2f}x") for k in ("speed_vs_plain", "speed_vs_lookup_off",
                                                                 "speed_vs_best_fixed"))
        print(f"| {row['block_size']} | {row['speed_vs_mlx_lm']:.2f}x | {plain} | {off} | {vs_best} | "
              f"{row['process_time_ratio']:.2f}x | "
              f"{row['tau'] if row['tau'] is None else format(row['tau'], '.2f')} | {row['identical']} | {top} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"command": shlex.join(sys.argv), "prompts": str(args.prompts), "num_prompts": len(prompts),
                  "max_tokens": args.max_tokens, "repeats": args.repeats, "mlx_lm_tps": base_tps, "best_fixed": best,
                  "rows": rows,
                  "load": os.getloadavg()}
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
