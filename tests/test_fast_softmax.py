"""The CPU fast-exp softmax, log-sum-exp and cross-entropy agree with MLX's, values and gradients."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.kernels import fast_softmax as fs


def test_exp_matches_numpy_across_the_float_range():
    x = mx.concatenate([mx.linspace(-120, 88, 20001), mx.array([-mx.inf, -1000.0, 0.0])])
    got = np.array(fs.exp(x))
    ref = np.exp(np.array(x, dtype=np.float64))
    normal = ref > 1e-37
    assert np.max(np.abs(got[normal] - ref[normal]) / ref[normal]) < 5e-6
    assert np.all(np.abs(got[~normal] - ref[~normal]) < 2e-38) and got[-3] == 0.0 and got[-2] == 0.0 and got[-1] == 1.0


@pytest.mark.parametrize("shape", [(3, 7), (2, 4, 5, 33)])
def test_softmax_and_logsumexp_match_mlx_with_gradients(shape):
    x = mx.random.normal(shape, key=mx.random.key(0)) * 4
    x = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(1)) < 0.3, -mx.inf, x)
    x = mx.concatenate([x, mx.zeros(shape[:-1] + (1,))], axis=-1)  # every row has a finite entry
    w = mx.random.normal(x.shape, key=mx.random.key(2))
    assert mx.allclose(fs.softmax(x), mx.softmax(x, axis=-1), atol=1e-6).item()
    assert mx.allclose(fs.logsumexp(x), mx.logsumexp(x, axis=-1), atol=1e-5).item()
    g1 = mx.grad(lambda x: (fs.softmax(x) * w).sum())(x)
    g2 = mx.grad(lambda x: (mx.softmax(x, axis=-1) * w).sum())(x)
    assert mx.allclose(g1, g2, atol=1e-6).item()
    y = mx.where(mx.isinf(x), 0.0, x)
    g1 = mx.grad(lambda y: (fs.logsumexp(y) * w[..., 0]).sum())(y)
    g2 = mx.grad(lambda y: (mx.logsumexp(y, axis=-1) * w[..., 0]).sum())(y)
    assert mx.allclose(g1, g2, atol=1e-6).item()


def test_softmax_any_shape_matches_mlx_without_a_trace_per_shape():
    for n in (5, 6, 300):  # a new length each call, as attention over a growing cache
        x = mx.random.normal((2, 3, 4, n), key=mx.random.key(n)) * 4
        x = mx.where(mx.arange(n) < 2, -mx.inf, x)  # masked columns, as left padding
        assert mx.allclose(fs.softmax_any_shape(x), mx.softmax(x, axis=-1), atol=1e-6).item()


def test_cross_entropy_matches_mlx():
    logits = mx.random.normal((4, 6, 50), key=mx.random.key(3)) * 3
    targets = mx.random.randint(0, 50, (4, 6), key=mx.random.key(4))
    ref = nn.losses.cross_entropy(logits, targets, reduction="none")
    assert mx.allclose(fs.cross_entropy(logits, targets), ref, atol=1e-5).item()
    g1 = mx.grad(lambda z: fs.cross_entropy(z, targets).sum())(logits)
    g2 = mx.grad(lambda z: nn.losses.cross_entropy(z, targets).sum())(logits)
    assert mx.allclose(g1, g2, atol=1e-6).item()


def test_other_dtypes_use_mlx():
    x = mx.random.normal((2, 9), key=mx.random.key(5)).astype(mx.bfloat16)
    assert mx.array_equal(fs.softmax(x), mx.softmax(x, axis=-1)).item()
