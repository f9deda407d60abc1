"""How long Ctrl-C waits during a long prefill, by prefill step size (issue 8).

Python sees SIGINT only between two bytecodes, and the engine's prefill spends each
chunk inside one ``mx.eval``: the wait is up to one chunk's time. This measures it
on a random target shaped like Qwen3-0.6B's layers (hidden 1024, 16/8 heads of 128,
MLP 3072; fewer layers to keep a chunk near the 5 s first reported), float32:

    python benchmarks/prefill_interrupt.py --layers 8 --prompt 4096 --steps 2048 512 --trials 4

For each step size: the whole prefill's time (median of ``--repeats``), then
``--trials`` runs interrupted by a SIGINT sent from another process at a random
moment of the prefill; the latency is from the kill to the ``KeyboardInterrupt``.
Step sizes alternate within the run. Prints one JSON line per step size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import time

import mlx.core as mx
from mlx_lm.models import qwen3

from dflash_mlx import generate_step, make_adapter


def target(layers: int):
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=1024, num_hidden_layers=layers, intermediate_size=3072,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                           vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960,
                           tie_word_embeddings=True)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return make_adapter(model)


def prefill_once(adapter, prompt: mx.array, step: int) -> None:
    for _ in generate_step(prompt, adapter, None, max_tokens=1, prefill_step_size=step):
        pass


def interrupted(adapter, prompt: mx.array, step: int, delay: float) -> float:
    """Seconds from a SIGINT sent ``delay`` s into the prefill to the KeyboardInterrupt."""
    killer = subprocess.Popen(["sh", "-c", f"sleep {delay:.3f}; kill -INT {os.getpid()}; date +%s.%N"],
                              stdout=subprocess.PIPE, text=True)
    try:
        prefill_once(adapter, prompt, step)
        caught = None  # finished before the signal
    except KeyboardInterrupt:
        caught = time.time()
    sent = float(killer.communicate()[0])
    if caught is None:  # the signal arrives after the prefill: swallow it
        try:
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        return float("nan")
    return caught - sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--steps", type=int, nargs="+", default=[2048, 512])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed(a.seed)
    mx.random.seed(a.seed)
    adapter = target(a.layers)
    prompt = mx.random.randint(0, 151936, (a.prompt,)).astype(mx.int32)
    prefill_once(adapter, prompt[:64], 64)  # warm-up

    totals = {s: [] for s in a.steps}
    for _ in range(a.repeats):
        for s in a.steps:
            tic = time.perf_counter()
            prefill_once(adapter, prompt, s)
            totals[s].append(time.perf_counter() - tic)
    waits = {s: [] for s in a.steps}
    for _ in range(a.trials):
        for s in a.steps:
            waits[s].append(interrupted(adapter, prompt, s, random.uniform(0.3, 0.9) * statistics.median(totals[s])))
    base = statistics.median(totals[a.steps[0]])
    for s in a.steps:
        got = [w for w in waits[s] if w == w]
        print(json.dumps({
            "prefill_step": s, "layers": a.layers, "prompt_tokens": a.prompt,
            "prefill_s_median": round(statistics.median(totals[s]), 2),
            "prefill_time_vs_first_step": round(statistics.median(totals[s]) / base, 3),
            "ctrl_c_wait_s": [round(w, 2) for w in got],
            "ctrl_c_wait_s_median": round(statistics.median(got), 2) if got else None,
            "ctrl_c_wait_s_max": round(max(got), 2) if got else None,
        }))


if __name__ == "__main__":
    main()
