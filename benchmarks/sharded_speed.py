#!/usr/bin/env python3
"""DFlash on a target sharded over local ranks, against mlx-lm's own sharded decoding of it.

Every generation is a fresh `mlx.launch --backend ring -n R` process: `dflash generate --json`
on one side, mlx-lm's `sharded_load` + `stream_generate` (this script with `--mlx-lm`) on the
other, on the same prompt, greedy, order rotated per prompt and repeat. Reported: per setting,
the median over prompts of the per-prompt median ratio of generation tokens/s (first token to
last, as both tools count it), tau, and whether the texts are equal.

    python benchmarks/sharded_speed.py --model OUT/target --draft-model OUT/drafter \\
        --ranks 2 -n 6 --repeats 3 --settings auto 4 8 --out sharded.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def mlx_lm_rank(model: str, prompt: str, max_tokens: int) -> None:
    """One rank of mlx-lm's sharded decoding; rank 0 prints {text, generation_tps, tokens}."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    model, tokenizer = sharded_load(model, tensor_group=group)
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        text += last.text
    if group.rank() == 0:
        print(json.dumps({"text": text, "generation_tps": last.generation_tps, "tokens": last.generation_tokens}))


def launch(ranks: int, command: list) -> dict:
    """Run ``command`` on ``ranks`` local ranks; the one JSON line rank 0 printed."""
    cmd = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(ranks), "--", *command]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--prompts", default=str(ROOT / "scripts" / "data" / "story_openings.jsonl"))
    ap.add_argument("-n", type=int, default=6, help="prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--settings", nargs="+", default=["auto"], help="--block-size values for dflash")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mlx-lm", nargs=3, metavar=("MODEL", "PROMPT", "MAX_TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mlx_lm:
        return mlx_lm_rank(args.mlx_lm[0], args.mlx_lm[1], int(args.mlx_lm[2]))
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows][: args.n]
    runs = {}  # (prompt index, setting) -> list of results
    for i, prompt in enumerate(prompts):
        for r in range(args.repeats):
            order = ["mlx_lm", *args.settings]
            shift = (i + r) % len(order)
            for setting in order[shift:] + order[:shift]:
                if setting == "mlx_lm":
                    cmd = [sys.executable, __file__, "--model", args.model, "--mlx-lm", args.model, prompt,
                           str(args.max_tokens)]
                else:
                    cmd = [str(BIN / "dflash"), "generate", "--model", args.model, "--draft-model", args.draft_model,
                           "-p", prompt, "--max-tokens", str(args.max_tokens), "--temp", "0", "--block-size", setting,
                           "--no-prompt-cache", "--json", "--quiet"]
                runs.setdefault((i, setting), []).append(launch(args.ranks, cmd))
                print(f"prompt {i + 1}/{len(prompts)} repeat {r + 1} {setting}: "
                      f"{runs[(i, setting)][-1]['generation_tps']:.1f} tok/s", file=sys.stderr)
    table = {}
    for setting in args.settings:
        ratios, taus, same = [], [], 0
        for i in range(len(prompts)):
            base = statistics.median(x["generation_tps"] for x in runs[(i, "mlx_lm")])
            ours = runs[(i, setting)]
            ratios.append(statistics.median(x["generation_tps"] for x in ours) / base)
            taus.append(statistics.median(x["tau"] for x in ours))
            same += all(x["text"] == runs[(i, "mlx_lm")][0]["text"] for x in ours)
        table[setting] = {"ratio": round(statistics.median(ratios), 3), "tau": round(statistics.median(taus), 2),
                          "identical": f"{same}/{len(prompts)}", "per_prompt": [round(x, 3) for x in ratios]}
    table["mlx_lm_tps"] = round(statistics.median(
        statistics.median(x["generation_tps"] for x in runs[(i, "mlx_lm")]) for i in range(len(prompts))), 1)
    table["ranks"] = args.ranks
    print(json.dumps(table, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"table": table, "runs": {f"{i}/{s}": v for (i, s), v in runs.items()}},
                                       indent=1))


if __name__ == "__main__":
    main()
