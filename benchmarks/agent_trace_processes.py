#!/usr/bin/env python3
"""Time to first token of agent-trace requests, each in a new `dflash generate` process:
cold (``--no-prompt-cache``) against warm (the prompt cache on disk, written by the
requests before it, each in its own process), and the same request again in a new
process (all of its prompt but the last token on disk).

    python benchmarks/agent_trace_processes.py --model M --draft-model D \\
        benchmarks/traces/agent_mbpp.jsonl benchmarks/traces/agent_gsm8k.jsonl

Per request: prompt tokens, reused, ``ttft_s`` from ``--json`` (finding and restoring
the entry included, process start and model load not), and the process's wall time.
Cold and warm alternate request by request, so a change in the machine's load hits both.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def generate(args, prompt: str, extra) -> dict:
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "generate", "--model", args.model, "-m", str(args.max_tokens),
           "--json", "--quiet", "--ignore-chat-template", "-p", prompt, *extra]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    tic = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"dflash generate failed: {r.stderr.strip()}")
    return {**json.loads(r.stdout), "wall_s": time.perf_counter() - tic}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = {"command": sys.argv, "traces": {}}
    for trace in args.traces:
        prompts = [json.loads(line)["prompt"] for line in trace.read_text().splitlines() if line.strip()]
        rows = []
        with tempfile.TemporaryDirectory() as folder:
            for i, prompt in enumerate(prompts):
                cold = generate(args, prompt, ["--no-prompt-cache"])
                warm = generate(args, prompt, ["--prompt-cache-dir", folder])
                again = generate(args, prompt, ["--prompt-cache-dir", folder])  # the same request, a new process
                rows.append({"i": i, "prompt_tokens": cold["prompt_tokens"], "reused": warm["prompt_tokens_reused"],
                             "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"],
                             "again_reused": again["prompt_tokens_reused"], "again_ttft_s": again["ttft_s"],
                             "cold_wall_s": cold["wall_s"], "warm_wall_s": warm["wall_s"],
                             "same_text": cold["text"] == warm["text"] == again["text"]})
                r = rows[-1]
                print(f"{trace.stem} {i}: {r['prompt_tokens']} tokens, {r['reused']} reused, TTFT cold "
                      f"{1e3 * r['cold_ttft_s']:.1f} ms, warm {1e3 * r['warm_ttft_s']:.1f} ms, again "
                      f"{1e3 * r['again_ttft_s']:.1f} ms ({r['again_reused']} reused), same text {r['same_text']}",
                      flush=True)
        later = rows[1:]  # the first request has nothing before it
        summary = {"ttft_ratio_sum": sum(r["warm_ttft_s"] for r in later) / sum(r["cold_ttft_s"] for r in later),
                   "ttft_ratio_median": statistics.median(r["warm_ttft_s"] / r["cold_ttft_s"] for r in later),
                   "again_ttft_ratio_sum": sum(r["again_ttft_s"] for r in rows) / sum(r["cold_ttft_s"] for r in rows),
                   "reused": sum(r["reused"] for r in rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                   "wall_ratio_sum": sum(r["warm_wall_s"] for r in later) / sum(r["cold_wall_s"] for r in later),
                   "all_same_text": all(r["same_text"] for r in rows)}
        print(f"{trace.stem}: {json.dumps(summary)}", flush=True)
        report["traces"][trace.stem] = {"summary": summary, "requests": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
