"""Seconds per all-sum of one [1, H] float32 row across the ranks of `mlx.launch --backend ring -n 2`."""
import sys
import time

import mlx.core as mx

g = mx.distributed.init()
x = mx.ones((1, int(sys.argv[1]) if len(sys.argv) > 1 else 64))
for _ in range(20):
    mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))
n, tic = 500, time.perf_counter()
for _ in range(n):
    mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))
if g.rank() == 0:
    print(f"ranks {g.size()}: {(time.perf_counter() - tic) / n * 1e6:.1f} us per all-sum of {x.size} floats")
