#!/usr/bin/env python3
"""What a prompt-cache entry costs to write and to restore, at Qwen3-0.6B's KV shape.

A target cache of 28 attention layers, 8 KV heads of 128 dims, bfloat16 (112 KiB per
token), filled with random rows, is stored (:meth:`PrefixStore.put`: safetensors, sha256,
atomic renames) and found again by a new store with no memory level, as a new process
would (lookup, size and sha256 check, load, restore into fresh caches). Medians of
``--repeats`` runs; the file is in the OS page cache after the first read.

    python benchmarks/prefix_restore.py --tokens 1024 4096 16384
"""

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from dflash_mlx.prompt_cache.entry import restore, take_snapshot
from dflash_mlx.prompt_cache.store import PrefixStore

LAYERS, HEADS, DIM = 28, 8, 128


def cache_of(n: int):
    cache = []
    for _ in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.bfloat16)
        c.update_and_fetch(k, k + 1)
        cache.append(c)
    mx.eval([c.keys for c in cache])
    return cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print("| tokens | entry MB | write s | restore s (lookup + check + load + fill) | restore GB/s |")
    print("|---:|---:|---:|---:|---:|")
    for n in a.tokens:
        cache = cache_of(n)
        tokens = list(range(n))
        writes, reads = [], []
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as folder:
                snap = take_snapshot(tokens, cache, None)
                tic = time.perf_counter()
                PrefixStore(folder, memory_entries=0).put("k", snap)
                writes.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                found, rows = PrefixStore(folder, memory_entries=0).lookup("k", tokens + [0])
                fresh = [KVCache() for _ in range(LAYERS)]
                restore(found, fresh, None)
                mx.eval([c.keys for c in fresh])
                reads.append(time.perf_counter() - tic)
                assert rows == n
        mb = snap.nbytes / 2**20
        r = statistics.median(reads)
        print(f"| {n} | {mb:.0f} | {statistics.median(writes):.3f} | {r:.3f} | {snap.nbytes / r / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
