"""Block attention of the drafter: B block queries over context K/V plus the block's own K/V.

The drafter's attention (DFLASH_SPEC.md section 4) lets the B block queries look at
the cached context rows and at the block's own rows. :func:`block_attention` computes
it without concatenating the context cache with the block every round: the Metal
kernel reads the two K/V sources separately, and the reference does two matmuls.

Covered: float16, bfloat16 and float32 inputs of one dtype, ``head_dim`` a multiple of
32 up to 256, any batch, heads, block size and context length (0 included). Everything
else, a machine without Metal, a CPU default device, and ``DFLASH_BLOCK_KERNEL=0`` use
:func:`block_attention_reference`; :func:`attention_path` says which ran and why.

The kernel's source, design and launch are in :mod:`dflash_mlx.kernels.block_attention_metal`
(its names are importable from here too); this file holds the ops reference, which defines
the result, and the choice between the two.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import mlx.core as mx

from ..errors import InputError
from .block_attention_metal import (  # noqa: F401 (the kernel's names, importable from here as before)
    _KERNEL, _SOURCE, INPUT_NAMES, OUTPUT_NAMES, SIMDGROUPS, KernelLaunch, kernel_inputs, kernel_launch)
from .block_attention_metal import metal_block_attention as _metal_block_attention

ENV_VAR = "DFLASH_BLOCK_KERNEL"
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes", "auto")

_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _relative_start(n_ctx: int, q_start: Optional[int], ctx_start: Optional[int]) -> int:
    """``delta = q_start - ctx_start``: how far the first query is from the first context row."""
    if q_start is None:
        return n_ctx
    if ctx_start is None:
        ctx_start = q_start - n_ctx
    delta = q_start - ctx_start
    if delta < n_ctx:
        raise InputError(
            f"block_attention: context rows [{ctx_start}, {ctx_start + n_ctx}) overlap the block "
            f"starting at q_start={q_start}; the context must come before the block"
        )
    return delta


def _check(queries, ctx_keys, ctx_values, block_keys, block_values, window) -> None:
    """Raise InputError naming the argument whose shape does not fit."""
    named = dict(queries=queries, ctx_keys=ctx_keys, ctx_values=ctx_values,
                 block_keys=block_keys, block_values=block_values)
    for name, x in named.items():
        if x.ndim != 4:
            raise InputError(f"block_attention: {name} must be [batch, heads, rows, head_dim], got shape {x.shape}")
    batch, n_heads, block, head_dim = queries.shape
    n_kv = block_keys.shape[1]
    want = (batch, n_kv, block, head_dim)
    for name in ("block_keys", "block_values"):
        if tuple(named[name].shape) != want:
            raise InputError(f"block_attention: {name} has shape {named[name].shape}, expected {list(want)}")
    n_ctx = ctx_keys.shape[2]
    for name in ("ctx_keys", "ctx_values"):
        if tuple(named[name].shape) != (batch, n_kv, n_ctx, head_dim):
            raise InputError(
                f"block_attention: {name} has shape {named[name].shape}, "
                f"expected {[batch, n_kv, n_ctx, head_dim]}"
            )
    if n_heads % n_kv:
        raise InputError(f"block_attention: {n_heads} query heads are not a multiple of {n_kv} KV heads")
    if block < 1:
        raise InputError("block_attention: the block has no rows")
    if window is not None and window < 1:
        raise InputError(f"block_attention: window {window} must be at least 1")


def block_attention_reference(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    *,
    scale: float,
    window: Optional[int] = None,
    causal: bool = False,
    q_start: Optional[int] = None,
    ctx_start: Optional[int] = None,
) -> mx.array:
    """The result the kernel must match, in plain MLX ops (float32 math).

    Same arguments and result as :func:`block_attention`. The context and block K/V
    are concatenated (a copy of the context rows per call, which the kernel avoids),
    scored in one matmul and weighted by a softmax whose exponential is
    ``2 ** (x * log2(e))``: on MLX's x86-64 CPU backend ``mx.exp`` is about twice as
    slow as ``mx.power`` (docs/benchmarks.md), and the drafter's attention is most of
    a draft there. A mask is applied only where some key is hidden (a window, or a
    causal block).
    """
    _check(queries, ctx_keys, ctx_values, block_keys, block_values, window)
    batch, n_heads, block, head_dim = queries.shape
    n_kv = block_keys.shape[1]
    n_ctx = ctx_keys.shape[2]
    delta = _relative_start(n_ctx, q_start, ctx_start)
    group = n_heads // n_kv
    # Query heads of one KV head side by side: row g * B + i is head kv * group + g, block row i.
    q = (_f32(queries) * scale).reshape(batch, n_kv, group * block, head_dim)
    keys, values = _f32(block_keys), _f32(block_values)
    if n_ctx > 0:
        keys = mx.concatenate([_f32(ctx_keys), keys], axis=2)
        values = mx.concatenate([_f32(ctx_values), values], axis=2)
    scores = q @ keys.swapaxes(-1, -2)  # [batch, n_kv, group * B, C + B]
    visible = _visible(block, n_ctx, delta, window, causal)
    if visible is not None:
        scores = mx.where(mx.tile(visible, (group, 1)), scores, -mx.inf)
    out = softmax_exp2(scores) @ values
    return out.reshape(batch, n_heads, block, head_dim).astype(queries.dtype)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _visible(block: int, n_ctx: int, delta: int, window: Optional[int], causal: bool) -> Optional[mx.array]:
    """[B, C + B] bool, True where block row i may see key j (context keys first), or
    None when every key is visible. Context row k sits ``delta - k`` before the first
    query; every query sees itself, so no row is all hidden."""
    if window is None and not causal:
        return None
    i = mx.arange(block)[:, None]
    j = mx.arange(block)[None, :]
    in_block = (j <= i) if causal else mx.ones((block, block), dtype=mx.bool_)
    if window is not None:
        in_block = in_block & (i - j < window)
    if n_ctx == 0:
        return in_block
    k = mx.arange(n_ctx)[None, :]
    in_ctx = (i + delta - k < window) if window is not None else mx.ones((block, n_ctx), dtype=mx.bool_)
    return mx.concatenate([in_ctx, in_block], axis=1)


_LOG2E = 1.4426950408889634


def softmax_exp2(scores: mx.array) -> mx.array:
    """Softmax over the last axis of float32 ``scores`` (``-inf`` entries get weight 0),
    with ``2 ** (x * log2(e))`` for the exponential (see :func:`block_attention_reference`)."""
    weights = mx.power(2.0, (scores - scores.max(axis=-1, keepdims=True)) * _LOG2E)
    return weights / weights.sum(axis=-1, keepdims=True)


def _environment_reason() -> Optional[str]:
    """Why the kernel cannot run here whatever the shape, or None when it can.

    Raises:
        InputError: ``DFLASH_BLOCK_KERNEL`` holds a value other than 0/off or 1/on.
    """
    value = os.environ.get(ENV_VAR)
    if value is not None:
        key = value.strip().lower()
        if key in _OFF:
            return f"{ENV_VAR}={value}"
        if key not in _ON:
            raise InputError(f"{ENV_VAR}={value!r}: expected 0/off (reference) or 1/on (kernel when possible)")
    if not mx.metal.is_available() or _KERNEL is None:
        return "Metal is not available (CPU backend)"
    if mx.default_device() != mx.gpu:
        return "the default device is the CPU"
    return None


def _shape_reason(queries, ctx_keys, ctx_values, block_keys, block_values) -> Optional[str]:
    """Why the kernel does not cover these inputs, or None when it does."""
    dtypes = {x.dtype for x in (queries, ctx_keys, ctx_values, block_keys, block_values)}
    if len(dtypes) > 1:
        return f"mixed input dtypes {sorted(str(d) for d in dtypes)}"
    if queries.dtype not in _DTYPES:
        return f"dtype {queries.dtype} is not float16, bfloat16 or float32"
    head_dim = queries.shape[-1]
    if head_dim % 32 or not 32 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a multiple of 32 in [32, 256]"
    return None


_last_path = {}


def _decide(queries, ctx_keys, ctx_values, block_keys, block_values) -> Tuple[str, str]:
    reason = _environment_reason() or _shape_reason(queries, ctx_keys, ctx_values, block_keys, block_values)
    if reason:
        return "reference", reason
    return "metal", "Metal is available and the shape is covered"


def block_attention(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    *,
    scale: float,
    window: Optional[int] = None,
    causal: bool = False,
    q_start: Optional[int] = None,
    ctx_start: Optional[int] = None,
) -> mx.array:
    """Attention of the block queries over context K/V then the block's own K/V.

    Runs the Metal kernel when Metal is available, the default device is the GPU,
    the shape is covered and ``DFLASH_BLOCK_KERNEL`` is not 0/off; otherwise
    :func:`block_attention_reference`. :func:`attention_path` reports the choice.

    Args:
        queries: [batch, n_heads, B, head_dim], RoPE applied, at absolute positions
            ``q_start .. q_start + B - 1``.
        ctx_keys, ctx_values: [batch, n_kv_heads, C, head_dim] context rows at absolute
            positions ``ctx_start .. ctx_start + C - 1`` (C may be 0). Slices of a
            preallocated cache are read in place.
        block_keys, block_values: [batch, n_kv_heads, B, head_dim], the block's own rows
            at the queries' positions.
        scale: score multiplier, usually ``head_dim ** -0.5``.
        window: sliding window W (sliding drafter layers, spec section 9): a query at
            position p sees keys at positions k with ``p - k < W``. None (default): all.
        causal: in-block attention causal (sliding layers) instead of bidirectional
            (default, full layers). Context rows are always visible up to the window.
        q_start, ctx_start: absolute positions; only their difference matters. Default:
            the context ends right before the block (``q_start = ctx_start + C``).

    Returns:
        [batch, n_heads, B, head_dim] in the queries' dtype. Query head h uses KV head
        ``h // (n_heads // n_kv_heads)``. Softmax statistics are float32.

    Raises:
        InputError: shapes that do not fit together, ``window`` < 1, context rows that
            overlap the block, or an unknown ``DFLASH_BLOCK_KERNEL`` value.
    """
    _check(queries, ctx_keys, ctx_values, block_keys, block_values, window)
    delta = _relative_start(ctx_keys.shape[2], q_start, ctx_start)
    path, reason = _decide(queries, ctx_keys, ctx_values, block_keys, block_values)
    _last_path.update({"block_attention": path, "reason": reason})
    if path == "metal":
        return _metal_block_attention(queries, ctx_keys, ctx_values, block_keys, block_values,
                                      scale, window, causal, delta)
    return block_attention_reference(
        queries, ctx_keys, ctx_values, block_keys, block_values,
        scale=scale, window=window, causal=causal, q_start=delta, ctx_start=0,
    )


def attention_path() -> dict:
    """Which block-attention path ran last, and why (for ``--json`` stats and stderr).

    Returns:
        ``{"block_attention": "metal" | "reference", "reason": str}`` for the latest
        :func:`block_attention` call; before any call, the path the environment allows
        (reason e.g. "Metal is not available (CPU backend)" or "DFLASH_BLOCK_KERNEL=0").

    Raises:
        InputError: an unknown ``DFLASH_BLOCK_KERNEL`` value (before any call).
    """
    if _last_path:
        return dict(_last_path)
    reason = _environment_reason()
    if reason:
        return {"block_attention": "reference", "reason": reason}
    return {"block_attention": "metal", "reason": "Metal is available (shape not seen yet)"}
