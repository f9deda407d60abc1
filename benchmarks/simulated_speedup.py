#!/usr/bin/env python3
"""DFlash's loop speed at a known acceptance, on a random-weight target of a real shape.

Question: at a realistic model size, does the measured speedup over plain decoding
reach at least 0.9 x the ideal speedup ``tau x t_AR / (t_draft + t_verify)``?

The target is Qwen3-0.6B's shape with random weights (hidden 1024, 28 layers, 16
heads / 8 KV heads, head_dim 128, MLP 3072, vocab 151936, tied embeddings), the
drafter a random 1-layer DFlash drafter of the same width. With
``--simulate-acceptance A`` (the library's :class:`dflash_mlx.bench.simulate.SimulatedDrafter`)
the real drafter runs for its cost and its proposals are replaced by the target's
greedy continuation for A slots and wrong tokens after, so tau = A + 1. Prompts are
random token ids (no tokenizer is needed). For each tau the baseline (this engine,
plain decoding) and DFlash alternate in this one process, after a warm-up, through
the same runner as ``dflash bench``; the repeats loop over all taus in turn.

Run (from the repository root; OpenBLAS makes float32 matmul much faster on CPU):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/simulated_speedup.py --taus 2 4 6 8 --max-tokens 64 --repeats 3 \\
        --out docs/bench/simulated-qwen3-0.6b

Writes ``results.json`` (the ``dflash bench`` schema, one "dataset" per tau), the
usual bench plots and ``simulated_speedup.png`` (measured and ideal speedup against
tau), and prints a Markdown table. Exit code 2 if measured < 0.9 x ideal at some tau.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from dflash_mlx import DFlashDrafter, DrafterArgs, bind_drafter, make_adapter
from dflash_mlx.bench.datasets import Sample
from dflash_mlx.bench.engines import DFlashEngine
from dflash_mlx.bench.report import build_report, write_report
from dflash_mlx.bench.runner import BenchConfig, DatasetResult, Runner
from dflash_mlx.cli.bench_tables import cycle_table, results_table
from dflash_mlx.drafter.config import default_target_layer_ids

BOUND = 0.9

# Qwen/Qwen3-0.6B config.json
QWEN3_0P6B = dict(
    model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True,
)
# Qwen/Qwen3-4B config.json
QWEN3_4B = dict(QWEN3_0P6B, hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                num_attention_heads=32, num_key_value_heads=8)
SHAPES = {"qwen3-0.6b": QWEN3_0P6B, "qwen3-4b": QWEN3_4B}
MASK_TOKEN_ID = 151669  # the released Qwen3 drafters' mask row


def random_pair(drafter_layers: int = 1, block_size: int = 16, seed: int = 0, dtype=mx.float32,
                shape: str = "qwen3-0.6b", bits: Optional[int] = None):
    """Random-weight target of a Qwen3 shape (``SHAPES``; adapter) and a bound random
    drafter of the same width; ``bits``: quantize both (mlx-lm's group size 64), one
    layer at a time so the float weights never all exist at once."""
    mx.random.seed(seed)
    config = SHAPES[shape]
    model = qwen3.Model(qwen3.ModelArgs(**config))
    model.set_dtype(dtype)
    _materialize(model, bits)
    target = make_adapter(model)
    n = config["num_hidden_layers"]
    args = DrafterArgs(
        hidden_size=config["hidden_size"], num_hidden_layers=drafter_layers,
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        target_layer_ids=default_target_layer_ids(n, drafter_layers), mask_token_id=MASK_TOKEN_ID,
        block_size=block_size, num_target_layers=n, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    )
    drafter = DFlashDrafter(args)
    drafter.set_dtype(dtype)
    _materialize(drafter, bits)
    return model, target, bind_drafter(drafter, target)


def _materialize(module, bits: Optional[int]) -> None:
    """Evaluate ``module``'s random weights, quantized first when ``bits`` is given:
    quantized while still lazy and evaluated one matrix at a time, so the float
    weights never all exist at once (Qwen3-4B's are 16 GB in float32)."""
    if bits is not None:
        nn.quantize(module, group_size=64, bits=bits)
    for _, value in tree_flatten(module.parameters()):
        mx.eval(value)


def plot_sweep(report: dict, path: Path) -> Path:
    from dflash_mlx.bench.plots import pyplot, save_figure

    plt = pyplot()
    rows = [(ds["dflash"][0]["tau"], ds["dflash"][0]["speedup_median_of_ratios"], ds["dflash"][0]["ideal_speedup"])
            for ds in report["datasets"]]
    fig, ax = plt.subplots(figsize=(4.6, 3.2), dpi=100)
    ax.plot([r[0] for r in rows], [r[2] for r in rows], "o--", color="black", label="ideal")
    ax.plot([r[0] for r in rows], [r[1] for r in rows], "o-", label="measured")
    ax.plot([r[0] for r in rows], [BOUND * r[2] for r in rows], ":", color="grey", label=f"{BOUND} x ideal")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xlabel("tau (tokens per verify)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Qwen3-0.6B shape, random weights, f32, B=16")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--taus", type=int, nargs="+", default=[2, 4, 6, 8], help="tau values; A = tau - 1")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="folder for results.json and the plots")
    args = p.parse_args()

    tic = time.perf_counter()
    model, target, drafter = random_pair(args.drafter_layers, args.block_size)
    print(f"built the random pair in {time.perf_counter() - tic:.1f} s", file=sys.stderr)
    mx.random.seed(1)
    samples = [Sample(f"random-{i}", prompt_ids=mx.random.randint(0, 151643, (args.prompt_tokens,)).tolist())
               for i in range(args.num_prompts)]
    config = BenchConfig(max_tokens=args.max_tokens, block_sizes=[args.block_size], repeats=1,
                         simulate_acceptance=args.taus[0] - 1, warmup_tokens=args.warmup_tokens)
    runner = Runner(target, drafter, DFlashEngine(target, None), config, stop_ids=())
    # Repeats outside, taus inside (reversed every other repeat): a busy spell on a
    # shared machine then hits every tau alike instead of one.
    results = {tau: DatasetResult(f"tau={tau}", len(samples), "ar") for tau in args.taus}
    for repeat in range(args.repeats):
        for tau in (args.taus if repeat % 2 == 0 else args.taus[::-1]):
            runner.config.simulate_acceptance = tau - 1
            tic = time.perf_counter()
            for run in runner.run_dataset(f"tau={tau}", samples).runs:
                run.repeat = repeat
                results[tau].runs.append(run)
            print(f"repeat {repeat} tau={tau}: {time.perf_counter() - tic:.1f} s", file=sys.stderr)
    results = [results[tau] for tau in args.taus]

    cfg = dict(vars(args), target="random Qwen3-0.6B shape (float32)", baseline="ar",
               drafter=f"random {args.drafter_layers}-layer DFlash drafter, width 1024")
    report = build_report(results, cfg, ["python", *sys.argv])
    from rich.console import Console

    Console(width=120).print(results_table(report))
    Console(width=120).print(cycle_table(report))
    print("\n| tau (A) | measured tau | t_AR ms/token | step ms | other ms "
          "| ideal | measured (median of ratios) | measured/ideal |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for tau, ds in zip(args.taus, report["datasets"]):
        d, b = ds["dflash"][0], ds["baseline"]
        c = d["cycle_ms"]
        ok &= (d["measured_over_ideal"] or 0) >= BOUND
        print(f"| {tau} ({tau - 1}) | {d['tau']:.2f} | {1e3 * b['s_per_token_median']:.1f} "
              f"| {c['decode']:.1f} | {c['other']:.1f} | {d['ideal_speedup']:.2f}x "
              f"| {d['speedup_median_of_ratios']:.2f}x | {d['measured_over_ideal']:.3f} |")
    if args.out:
        out = Path(args.out)
        write_report(report, out)
        plot_sweep(report, out / "simulated_speedup.png")
        print(f"wrote {out}/results.json, {out}/simulated_speedup.png", file=sys.stderr)
    print(f"PASS: measured >= {BOUND} x ideal at every tau" if ok else f"FAIL: measured < {BOUND} x ideal somewhere")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
