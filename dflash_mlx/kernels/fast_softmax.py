"""Softmax, log-sum-exp and log-softmax with a vectorised exp for MLX's CPU backend.

exp is ``2^n * p(r)``: ``n = floor(x * log2(e))``, ``p`` a degree-6 polynomial for ``2^r`` on ``[0, 1)``, ``2^n`` built
in the float's exponent bits; relative error under 5e-6, ``exp(-inf)`` exactly 0. It is used for float32 inputs when the
default device is the CPU and ``DFLASH_FAST_EXP`` is not 0; otherwise these are ``mx.softmax``, ``mx.logsumexp`` and
``mx.exp``. Gradients are the exact formulas (custom VJPs).
"""

import os

import mlx.core as mx

ENV_VAR = "DFLASH_FAST_EXP"
_LOG2E = 1.4426950408889634
# 2^r on [0, 1), least squares over 20,001 points (highest power first).
_POLY = (2.18712623e-04, 1.23824155e-03, 9.68618629e-03, 5.54789125e-02, 2.40231097e-01, 6.93146838e-01, 1.00000001e+00)


def _exp_parts(x: mx.array):  # p(r) and the int32 bits of 2^n: one kernel for any shape (compiled below)
    y = mx.clip(x * _LOG2E, -127.0, 127.0)  # -127: exponent bits 0, so the result is exactly 0
    n = mx.floor(y)
    r = y - n
    p = _POLY[0]
    for c in _POLY[1:]:
        p = p * r + c
    return p, (n.astype(mx.int32) + 127) << 23


_exp_parts = mx.compile(_exp_parts, shapeless=True)


def _exp(x: mx.array) -> mx.array:
    p, bits = _exp_parts(x)  # ``view`` cannot be shapeless: it stays outside
    return p * bits.view(mx.float32)


# Shaped compiles: a new input shape is traced once.
_exp_kernel = mx.compile(_exp)


def _softmax_eager(x: mx.array) -> mx.array:
    e = _exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


_softmax = mx.compile(_softmax_eager)


@mx.compile
def _softmax_vjp(y: mx.array, g: mx.array) -> mx.array:
    return y * (g - (g * y).sum(axis=-1, keepdims=True))


@mx.compile
def _logsumexp(x: mx.array) -> mx.array:
    m = mx.stop_gradient(x.max(axis=-1, keepdims=True))
    m = mx.where(mx.isinf(m), 0.0, m)  # a row of -inf: log(0) = -inf, not nan
    return (m + mx.log(_exp(x - m).sum(axis=-1, keepdims=True))).squeeze(-1)


@mx.compile
def _logsumexp_vjp(x: mx.array, lse: mx.array, g: mx.array) -> mx.array:
    return g[..., None] * _exp(x - lse[..., None])


@mx.custom_function
def _fast_softmax(x: mx.array) -> mx.array:
    return _softmax(x)


@_fast_softmax.vjp
def _fast_softmax_vjp(primals, cotangent, output):
    return _softmax_vjp(output, cotangent)


@mx.custom_function
def _fast_logsumexp(x: mx.array) -> mx.array:
    return _logsumexp(x)


@_fast_logsumexp.vjp
def _fast_logsumexp_vjp(primals, cotangent, output):
    x = primals[0] if isinstance(primals, (tuple, list)) else primals  # one input comes bare
    return _logsumexp_vjp(x, output, cotangent)


def use_fast_exp() -> bool:
    """True when the default device is the CPU and ``DFLASH_FAST_EXP`` is not 0."""
    return mx.default_device() == mx.cpu and os.environ.get(ENV_VAR, "1") not in ("0", "off", "false", "no")


def exp(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x`` (no gradient: for values such as probabilities)."""
    return _exp_kernel(x) if use_fast_exp() and x.dtype == mx.float32 else mx.exp(x)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (float32 on the CPU path; other dtypes use ``mx.softmax``)."""
    return _fast_softmax(x) if use_fast_exp() and x.dtype == mx.float32 else mx.softmax(x, axis=-1)


def softmax_any_shape(x: mx.array) -> mx.array:
    """:func:`softmax` without a compiled trace (no gradient), for inputs whose shape changes
    at every call (attention over a growing cache)."""
    return _softmax_eager(x) if use_fast_exp() and x.dtype == mx.float32 else mx.softmax(x, axis=-1)


def logsumexp(x: mx.array) -> mx.array:
    """``log(sum(exp(x)))`` over the last axis, which it drops."""
    return _fast_logsumexp(x) if use_fast_exp() and x.dtype == mx.float32 else mx.logsumexp(x, axis=-1)


def log_softmax(x: mx.array) -> mx.array:
    """``x - logsumexp(x)`` over the last axis."""
    return x - logsumexp(x)[..., None]


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Cross-entropy per row, nats: ``logsumexp(logits) - logits[target]``.

    Args:
        logits: [..., V] float32; targets: [...] int token ids.
    """
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    return logsumexp(logits) - picked
