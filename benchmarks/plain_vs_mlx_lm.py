#!/usr/bin/env python3
"""Plain decoding (no drafter) in this engine vs mlx-lm's ``stream_generate``.

Question: on stories260K float32, are the greedy tokens identical, and is our
decode time per token within 10% of mlx-lm's?

The two engines alternate in one process (A B A B ...) after a warm-up of each.
Per run, the decode time per token is measured the same way for both, in the
consumer loop with ``time.perf_counter``: from the first yielded token to the
last, divided by the decode steps (tokens - 1; a final stop token, which mlx-lm
yields and we cut, counts as a step for both). Prompt processing is excluded.
Process CPU time per token is reported too: it is less disturbed by other load.

Run from the repository root (preloading OpenBLAS speeds up MLX's float32 CPU matmul):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/plain_vs_mlx_lm.py --runs 5

Without ``--model`` the llama2.c stories260K checkpoint in ../shared is converted
into a temporary folder. PASS needs identical tokens in every run and the median
of the per-run ratios (ours/mlx-lm, each pair run back to back) <= 1.10; the ratio
of the medians is printed too. Exits 1 if any run's tokens differ, 2 if the bound fails.
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_lm import stream_generate as mlx_stream_generate

from dflash_mlx import load, stream_generate
from dflash_mlx.bench.report import machine_info
from dflash_mlx.targets.fused import unfused
from story_openings import convert_stories260k  # benchmarks/ is on the path when run as a script

BOUND = 1.10


def timed(responses, tokens_of):
    """Consume a stream; return (token ids, decode s/token, total s, decode CPU s/token).

    CPU time (all threads of this process) is less disturbed by other load on the machine.
    """
    start = time.perf_counter()
    tokens, stamps, cpu = [], [], []
    for r in responses:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        tokens += tokens_of(r)
    total = time.perf_counter() - start
    steps = max(len(stamps) - 1, 1)
    return tokens, (stamps[-1] - stamps[0]) / steps, total, (cpu[-1] - cpu[0]) / steps


def run_ours(pair, ids, n):
    # One response per target forward in plain mode; a stop token is already cut.
    return timed(stream_generate(pair.target, pair.tokenizer, ids, None, max_tokens=n), lambda r: r.tokens)


def run_mlx_lm(pair, ids, n):
    # One response per token; the last one carries the stop token if it stopped. mlx-lm runs
    # the model with its own modules, as mlx-lm loads it (ours has its norms and RoPE fused on a CPU).
    with unfused(pair.model):
        return timed(
            mlx_stream_generate(pair.model, pair.tokenizer, ids, max_tokens=n),
            lambda r: [] if r.finish_reason == "stop" else [r.token],
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="converted mlx-lm folder (default: convert ../shared stories260K)")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    print("command:", shlex.join([sys.executable, *sys.argv]))
    env = machine_info()
    for k, v in env.items():
        print(f"  {k}: {v}")

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = str(convert_stories260k(Path(tmp.name) / "stories260K"))
    pair = load(args.model)
    ids = pair.tokenizer.encode(args.prompt)
    engines = {"ours": run_ours, "mlx_lm": run_mlx_lm}

    for _ in range(args.warmup):
        for fn in engines.values():
            fn(pair, ids, args.max_tokens)

    runs = {name: [] for name in engines}
    identical = True
    for i in range(args.runs):
        out = {name: fn(pair, ids, args.max_tokens) for name, fn in engines.items()}  # A then B
        same = out["ours"][0] == out["mlx_lm"][0]
        identical &= same
        for name, (toks, per_tok, total, cpu) in out.items():
            runs[name].append({"tokens": len(toks), "ms_per_token": per_tok * 1e3, "total_s": total,
                               "cpu_ms_per_token": cpu * 1e3})
        print(f"run {i + 1}: ours {out['ours'][1] * 1e3:.3f} ms/tok, mlx-lm {out['mlx_lm'][1] * 1e3:.3f} ms/tok, "
              f"{len(out['ours'][0])} tokens, identical={same}")

    med = {n: statistics.median(r["ms_per_token"] for r in rs) for n, rs in runs.items()}
    med_total = {n: statistics.median(r["total_s"] for r in rs) for n, rs in runs.items()}
    med_cpu = {n: statistics.median(r["cpu_ms_per_token"] for r in rs) for n, rs in runs.items()}
    per_run = [a["ms_per_token"] / b["ms_per_token"] for a, b in zip(runs["ours"], runs["mlx_lm"])]
    ratio_runs, ratio_meds = statistics.median(per_run), med["ours"] / med["mlx_lm"]
    # The bound is judged on the paired (same-moment) ratios: robust to load drifting between runs.
    passed = identical and ratio_runs <= BOUND

    print(f"\n{'engine':<8} {'ms/token':>9} {'tokens/s':>9} {'total s':>8} {'CPU ms/token':>13}   (medians)")
    for n in engines:
        print(f"{n:<8} {med[n]:>9.3f} {1e3 / med[n]:>9.1f} {med_total[n]:>8.3f} {med_cpu[n]:>13.3f}")
    print(f"ratio ours/mlx-lm: median of per-run ratios {ratio_runs:.3f}, ratio of medians {ratio_meds:.3f}")
    print(f"tokens identical in every run: {'yes' if identical else 'NO'}")
    print(f"{'PASS' if passed else 'FAIL'} (bound: median per-run ratio <= {BOUND:.2f}, tokens identical)")

    if args.json_out:
        args.json_out.write_text(json.dumps({
            "command": shlex.join([sys.executable, *sys.argv]), "env": env, "args": {
                k: str(v) for k, v in vars(args).items()}, "runs": runs,
            "median_ms_per_token": med, "median_total_s": med_total,
            "median_cpu_ms_per_token": med_cpu, "per_run_ratio": per_run,
            "ratio_median_of_runs": ratio_runs, "ratio_of_medians": ratio_meds,
            "tokens_identical": identical, "pass": passed}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if passed else (1 if not identical else 2)


if __name__ == "__main__":
    sys.exit(main())
