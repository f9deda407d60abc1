#!/usr/bin/env python3
"""Continuous batching at Qwen3-0.6B's shape (random weights, float32), in one process,
with simulated acceptance (issue 21).

N sequences (random 32-token prompts) decode ``--max-tokens`` tokens each:

- **batched**: one :class:`~dflash_mlx.decode.batch.BatchDecoder` (one drafter pass and
  one verify per step for all N), drafts replaced after the real batched drafter pass
  by each sequence's greedy continuation for the first A slots and wrong tokens after
  (as ``dflash bench --simulate-acceptance A`` does for one sequence: tau = A + 1);
- **one at a time**: the N sequences one after another through ``generate_step`` with
  ``SimulatedDrafter`` at the same A and block size (what ``--max-batch 1`` does);
- **mlx-lm BatchGenerator**: plain batched decoding of the same N prompts (what
  ``mlx_lm.server`` runs), no drafter.

Aggregate tokens/s of each (all tokens over the wall time, prefill included), after
``--warmup`` untimed rounds of each per batch size, the ratios in the same run, and
whether every batched sequence equals its solo greedy run.

    python benchmarks/batch_simulated.py --batches 1,2,4,8 --accept 7 --block-size 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step as mlx_generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulated_speedup import random_pair  # noqa: E402

from dflash_mlx import generate_step  # noqa: E402
from dflash_mlx.bench.simulate import SimulatedDrafter  # noqa: E402
from dflash_mlx.decode.batch import BatchDecoder  # noqa: E402
from dflash_mlx.decode.stopping import StopCondition  # noqa: E402


class SimulatedBatchDrafts:
    """The real one-pass batch drafting (its cost), then each row's drafts replaced:
    right for the first ``accept`` slots (from ``sequences[row]``), wrong after."""

    def __init__(self, real, sequences: List[List[int]], accept: int, vocab: int):
        self.real, self.pending, self.accept, self.vocab = real, list(sequences), accept, vocab
        self.rows: List[list] = []  # [sequence, position of t_last]

    @property
    def cache(self):
        return self.real.cache

    def join(self, context: Optional[mx.array], cache=None) -> None:
        self.real.join(context, cache)
        self.rows.append([self.pending.pop(0), 0 if context is None else context.shape[1]])

    def keep(self, rows) -> None:
        self.real.keep(rows)
        self.rows = [self.rows[i] for i in rows]

    def draft(self, tokens: mx.array, context: Optional[mx.array], counts: List[int], block_size: int) -> mx.array:
        mx.eval(self.real.draft(tokens, context, counts, block_size))
        out = []
        for row, n in zip(self.rows, counts):
            row[1] += n
            seq, pos = row
            right = [seq[pos + k] if pos + k < len(seq) else 0 for k in range(1, block_size)]
            out.append([t if k < self.accept else (t + 1) % self.vocab for k, t in enumerate(right)])
        return mx.array(out, dtype=mx.int32)


def batched(target, drafter, prompts, sequences, args) -> tuple:
    tic = time.perf_counter()
    decoder = BatchDecoder(target, drafter, args.block_size)
    decoder.batch_drafter = SimulatedBatchDrafts(decoder.batch_drafter, sequences, args.accept, target.vocab_size)
    out = {}
    for k, p in enumerate(prompts):
        joining = decoder.start(k, p, None, StopCondition(args.max_tokens), step_size=2048)
        out[k] = list(joining.advance().tokens)
    while len(decoder):
        keys = [s.key for s in decoder.sequences]
        for key, r in zip(keys, decoder.step()):
            out[key] += r.tokens
    return time.perf_counter() - tic, [out[k] for k in range(len(prompts))]


def one_at_a_time(target, drafter, prompts, sequences, args) -> float:
    tic = time.perf_counter()
    for p, seq in zip(prompts, sequences):
        sim = SimulatedDrafter(drafter, seq, args.accept, target.vocab_size)
        for _ in generate_step(mx.array(p, dtype=mx.int32), target, sim, max_tokens=args.max_tokens,
                               block_size=args.block_size):
            pass
    return time.perf_counter() - tic


def mlx_lm_batch(model, prompts, args) -> float:
    tic = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert(prompts, [args.max_tokens] * len(prompts))
    while gen.next_generated():
        pass
    gen.close()
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--accept", type=int, default=7, help="A: drafts right per block (tau = A + 1)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of each per batch size first")
    args = p.parse_args()
    model, target, drafter = random_pair(block_size=args.block_size)
    rng = np.random.default_rng(0)
    sizes = [int(b) for b in args.batches.split(",")]
    prompts = [rng.integers(0, 151_000, args.prompt_tokens).tolist() for _ in range(max(sizes))]
    sequences = []
    for prompt in prompts:  # the target's greedy continuation (what the simulated drafts follow)
        gen = mlx_generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=args.max_tokens + args.block_size)
        sequences.append(prompt + [int(t) for t, _ in gen])
    print("| sequences | batched tok/s | one at a time tok/s | mlx-lm BatchGenerator tok/s | batched / one at a time "
          "| batched / mlx-lm | batched output = solo greedy |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        rows = []
        for _ in range(args.warmup):  # untimed: compiled shapes and first-use costs, as a running server has paid
            batched(target, drafter, prompts[:n], sequences[:n], args)
            one_at_a_time(target, drafter, prompts[:n], sequences[:n], args)
            mlx_lm_batch(model, prompts[:n], args)
        for _ in range(args.repeats):
            b_s, tokens = batched(target, drafter, prompts[:n], sequences[:n], args)
            rows.append((b_s, one_at_a_time(target, drafter, prompts[:n], sequences[:n], args),
                         mlx_lm_batch(model, prompts[:n], args), tokens))
        total = n * args.max_tokens
        exact = all(t == s[len(p):len(p) + args.max_tokens] for t, s, p in zip(rows[-1][3], sequences, prompts))
        b, o, m = (statistics.median(total / r[i] for r in rows) for i in range(3))
        ratio_o = statistics.median(r[1] / r[0] for r in rows)
        ratio_m = statistics.median(r[2] / r[0] for r in rows)
        print(f"| {n} | {b:.1f} | {o:.1f} | {m:.1f} | {ratio_o:.2f}x | {ratio_m:.2f}x | {exact} |", flush=True)


if __name__ == "__main__":
    main()
