#!/usr/bin/env python3
"""Drafting cost against context length, with and without the drafter context window.

Question: with ``--draft-window SINK,WINDOW`` (DFLASH_SPEC.md section 5), does the
drafter's cost per step stop growing with the context, and what does it do to tau
and tokens/s?

Pair: the random-weight Qwen3-0.6B-shaped target of ``simulated_speedup.py`` (float32)
and a random DFlash drafter of the same width with 5 layers (as the released Qwen3
b16 drafters), block 16, simulated acceptance A (``SimulatedDrafter``: the real
drafter runs for its cost, its proposals are the target's greedy continuation for A
slots), so tau = A + 1 whatever the window; or, with ``--accept-trace FILE``, the
accepted lengths a real run recorded, replayed block by block. Prompts are random token ids.

For each prompt length the prompt but its last token is prefilled once (the target
cache is trimmed back to it after every run); every run then decodes from the last
prompt token, as a chat turn continues a kept cache: plain decoding (``ar``), DFlash
without a window, DFlash with the window. Each DFlash run first ingests the prompt's
context features into a fresh drafter cache ("ingest", timed apart: with the window
only the sink and window rows are computed). Engines alternate, order reversed on
every other repeat; figures are medians over repeats.

Run (from the repository root, holding the machine-wide benchmark lock):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        flock /tmp/dflash-bench.lock python benchmarks/draft_window.py \\
        --prompt-tokens 256 2048 8192 --max-tokens 32 --repeats 2 --out docs/bench/draft-window

Writes ``results.json`` and ``draft_window.png`` (draft ms per step against prompt
length) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx import GenerationStats, generate_step
from chunked_prefill import prefill  # benchmarks/ is on the path when run as a script
from dflash_mlx.prompt_cache.pair import trim_cache
from dflash_mlx.bench.report import machine_info
from dflash_mlx.bench.simulate import SimulatedDrafter, read_trace
from simulated_speedup import random_pair


def run(target, drafter, last: int, cache, rows: int, max_tokens: int, block_size: int, draft_cache=None) -> dict:
    """One generation from the last prompt token over a cache holding ``rows`` rows
    (trimmed back to them afterwards)."""
    stats = GenerationStats(block_size=block_size if drafter is not None else 1)
    tokens, first, tic = [], None, time.perf_counter()
    for step in generate_step(mx.array([last], dtype=mx.int32), target, drafter, max_tokens=max_tokens,
                              block_size=block_size if drafter is not None else None, prompt_cache=cache,
                              draft_cache=draft_cache, stats=stats):
        now = time.perf_counter()
        first = first if first is not None else (now, len(step.tokens))
        tokens += step.tokens
        last_time = now
    trim_cache(cache, rows)
    decode_s = last_time - first[0]
    return {
        "tokens": tokens, "decode_tps": (len(tokens) - first[1]) / decode_s if decode_s > 0 else None,
        "tau": stats.tau if drafter is not None else None, "steps": stats.steps,
        "step_ms": 1e3 * stats.phase_s["decode"] / stats.steps if stats.steps else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--accept", type=int, default=5, help="simulated acceptance A (tau = A + 1)")
    p.add_argument("--accept-trace", default=None,
                   help="replay this acceptance trace (dflash generate --json output) instead of a fixed A")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--window", default="64,1024", help="SINK,WINDOW")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--draft-only", action="store_true",
                   help="time the drafter alone (random context features, no target forward)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sink, size = (int(v) for v in args.window.split(","))
    B = args.block_size

    accept = read_trace(args.accept_trace) if args.accept_trace else args.accept
    _, target, drafter = random_pair(args.drafter_layers, B)
    if args.draft_only:
        return draft_only(drafter, args, (sink, size))
    rows_out = []
    for P in args.prompt_tokens:
        mx.random.seed(P)
        prompt = mx.random.randint(0, 151643, (P,)).astype(mx.int32)
        cache = target.make_cache(B)
        tic = time.perf_counter()
        _, features = prefill(target, prompt[:-1], cache, drafter.target_layer_ids)
        mx.eval(features, [c.state for c in cache])
        prefill_s = time.perf_counter() - tic
        last = int(prompt[-1].item())
        greedy = run(target, None, last, cache, P - 1, args.max_tokens + B, B)["tokens"]
        sequence = prompt.tolist() + greedy

        def dflash(window):
            drafter.set_draft_window(window)
            sim = SimulatedDrafter(drafter, sequence, accept, target.vocab_size)
            draft_cache = drafter.make_cache()
            tic = time.perf_counter()
            drafter.ingest(features, draft_cache)
            mx.eval([c.state for c in draft_cache])
            ingest_ms = 1e3 * (time.perf_counter() - tic)
            out = run(target, sim, last, cache, P - 1, args.max_tokens, B, draft_cache)
            out.update(ingest_ms=ingest_ms, matches=out["tokens"] == greedy[: args.max_tokens])
            return out

        engines = {"ar": lambda: run(target, None, last, cache, P - 1, args.max_tokens, B),
                   "dflash": lambda: dflash(None), f"dflash window {sink},{size}": lambda: dflash((sink, size))}
        dflash((sink, size))  # warm-up (allocation, first-call costs)
        runs = {name: [] for name in engines}
        for r in range(args.repeats):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                runs[name].append(engines[name]())
            print(f"P={P} repeat {r} done", file=sys.stderr, flush=True)
        base = statistics.median(x["decode_tps"] for x in runs["ar"])
        for name, rs in runs.items():
            med = lambda k: statistics.median(x[k] for x in rs) if rs[0].get(k) is not None else None  # noqa: E731
            rows_out.append({"prompt_tokens": P, "engine": name, "tau": med("tau"), "decode_tps": med("decode_tps"),
                             "speedup": med("decode_tps") / base, "step_ms": med("step_ms"),
                             "ingest_ms": med("ingest_ms"),
                             "prefill_s": prefill_s, "outputs_identical": all(x.get("matches", True) for x in rs)})
        del cache, features
        mx.clear_cache()

    print("\n| prompt tokens | engine | tau | decode tok/s | speedup vs ar | ms/step "
          "| ingest ms | output = greedy |")
    print("|---:|---|---:|---:|---:|---:|---:|:---:|")
    f = lambda v, d=1: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows_out:
        print(f"| {r['prompt_tokens']} | {r['engine']} | {f(r['tau'], 2)} | {f(r['decode_tps'], 2)} "
              f"| {f(r['speedup'], 2)}x | {f(r['step_ms'])} | {f(r['ingest_ms'])} "
              f"| {'yes' if r['outputs_identical'] else 'NO'} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"command": ["python", *sys.argv], "config": vars(args), "machine": machine_info(),
                  "target": "random Qwen3-0.6B shape (float32)",
                  "drafter": f"random {args.drafter_layers}-layer DFlash drafter, width 1024", "rows": rows_out}
        (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(rows_out, out / "draft_window.png", sink, size)
        print(f"wrote {out}/results.json, {out}/draft_window.png", file=sys.stderr)
    return 0 if all(r["outputs_identical"] for r in rows_out) else 2


def draft_cost(drafter, context: int, window, block_size: int, drafts: int = 5) -> dict:
    """Median ms of one draft (one new context row) after ``context`` rows of random
    features, and the ms to ingest those rows; the drafter's cost does not depend on
    the feature values."""
    drafter.set_draft_window(window)
    cache = drafter.make_cache()
    F = len(drafter.target_layer_ids) * drafter.args.hidden_size
    features = mx.random.normal((1, context, F))
    mx.eval(features)
    tic = time.perf_counter()
    drafter.ingest(features, cache)
    mx.eval([c.state for c in cache])
    ingest_ms = 1e3 * (time.perf_counter() - tic)
    times = []
    for _ in range(drafts + 1):  # the first one is a warm-up
        row = mx.random.normal((1, 1, F))
        mx.eval(row)
        tic = time.perf_counter()
        mx.eval(drafter.draft(mx.array([1], dtype=mx.int32), row, cache, block_size))
        times.append(1e3 * (time.perf_counter() - tic))
    return {"draft_ms": statistics.median(times[1:]), "ingest_ms": ingest_ms,
            "visible_rows": cache[0].fetch()[0].shape[2] if window else cache[0].offset}


def draft_only(drafter, args, window) -> int:
    """``--draft-only``: the drafting-cost curve, context by context, window off and on."""
    rows = []
    for P in args.prompt_tokens:
        for name, w in (("dflash", None), (f"dflash window {window[0]},{window[1]}", window)):
            r = draft_cost(drafter, P, w, args.block_size)
            rows.append({"prompt_tokens": P, "engine": name, **r})
            print(f"P={P} {name}: {r}", file=sys.stderr, flush=True)
            mx.clear_cache()
    print("\n| context rows | engine | rows the drafter attends | draft ms (median of 5) | ingest ms |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['engine']} | {r['visible_rows']} | {r['draft_ms']:.1f} | {r['ingest_ms']:.0f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"command": ["python", *sys.argv], "config": vars(args), "machine": machine_info(),
                  "drafter": f"random {args.drafter_layers}-layer DFlash drafter, width 1024", "rows": rows}
        (out / "draft_only.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(rows, out / "draft_only.png", *window)
    return 0


def plot(rows, path: Path, sink: int, size: int) -> Path:
    from dflash_mlx.bench.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 3.2), dpi=100)
    for name in dict.fromkeys(r["engine"] for r in rows if r["engine"] != "ar"):
        pts = [(r["prompt_tokens"], r["draft_ms"]) for r in rows if r["engine"] == name]
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("draft ms per step")
    ax.set_ylim(bottom=0)
    ax.set_title("Qwen3-0.6B shape, random weights, f32, B=16")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
