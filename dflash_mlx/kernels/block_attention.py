"""The drafter's block attention (spec section 4): B block queries over the context K/V, then the block's own K/V,
without concatenating the two. :func:`block_attention` runs the Metal kernel of :mod:`.block_attention_metal` where it
can and :func:`block_attention_reference` elsewhere; :func:`attention_path` says which runs for given inputs and why.
:func:`masked_attention` takes any mask instead (training's blocks, a batch's padding).

The kernel covers float16, bfloat16 and float32 inputs of one dtype with ``head_dim`` a multiple
of 32 up to 256, on a GPU default device with Metal, unless ``DFLASH_BLOCK_KERNEL`` is 0/off."""

import os
from typing import Callable, Optional, Tuple

import mlx.core as mx

from ..errors import InputError
from .block_attention_metal import KERNEL_AVAILABLE, metal_block_attention
from .fast_softmax import softmax, softmax_any_shape

ENV_VAR = "DFLASH_BLOCK_KERNEL"
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes", "auto")
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _relative_start(n_ctx: int, q_start: Optional[int], ctx_start: Optional[int]) -> int:
    """``q_start - ctx_start``; the default puts the context right before the block."""
    if q_start is None:
        return n_ctx
    if ctx_start is None:
        ctx_start = q_start - n_ctx
    if q_start - ctx_start < n_ctx:
        raise InputError(f"block_attention: context rows [{ctx_start}, {ctx_start + n_ctx}) overlap the block "
                         f"starting at q_start={q_start}; the context must come before the block")
    return q_start - ctx_start


def _check(queries, ctx_keys, ctx_values, block_keys, block_values, window) -> None:
    """Raise InputError naming the argument whose shape does not fit."""
    named = dict(queries=queries, ctx_keys=ctx_keys, ctx_values=ctx_values,
                 block_keys=block_keys, block_values=block_values)
    for name, x in named.items():
        if x.ndim != 4:
            raise InputError(f"block_attention: {name} must be [batch, heads, rows, head_dim], got shape {x.shape}")
    batch, n_heads, block, head_dim = queries.shape
    n_kv, n_ctx = block_keys.shape[1], ctx_keys.shape[2]
    for name, rows in (("block_keys", block), ("block_values", block), ("ctx_keys", n_ctx), ("ctx_values", n_ctx)):
        want = [batch, n_kv, rows, head_dim]
        if list(named[name].shape) != want:
            raise InputError(f"block_attention: {name} has shape {named[name].shape}, expected {want}")
    if n_heads % n_kv:
        raise InputError(f"block_attention: {n_heads} query heads are not a multiple of {n_kv} KV heads")
    if block < 1:
        raise InputError("block_attention: the block has no rows")
    if window is not None and window < 1:
        raise InputError(f"block_attention: window {window} must be at least 1")


def block_attention_reference(queries: mx.array, ctx_keys: mx.array, ctx_values: mx.array, block_keys: mx.array,
                              block_values: mx.array, *, scale: float, window: Optional[int] = None,
                              causal: bool = False, q_start: Optional[int] = None,
                              ctx_start: Optional[int] = None) -> mx.array:
    """The result the kernel must match, in plain MLX ops with float32 math; arguments, result
    and errors as :func:`block_attention`'s."""
    _check(queries, ctx_keys, ctx_values, block_keys, block_values, window)
    batch, n_heads, block, head_dim = queries.shape
    n_kv, n_ctx = block_keys.shape[1], ctx_keys.shape[2]
    delta = _relative_start(n_ctx, q_start, ctx_start)
    group = n_heads // n_kv
    # Row g * B + i is query head kv * group + g, block row i.
    q = (_f32(queries) * scale).reshape(batch, n_kv, group * block, head_dim)
    keys = mx.concatenate([_f32(ctx_keys), _f32(block_keys)], axis=2)
    values = mx.concatenate([_f32(ctx_values), _f32(block_values)], axis=2)
    scores = q @ keys.swapaxes(-1, -2)  # [batch, n_kv, group * B, C + B]
    if (visible := _visible(block, n_ctx, delta, window, causal)) is not None:
        scores = mx.where(mx.tile(visible, (group, 1)), scores, -mx.inf)
    out = softmax_any_shape(scores) @ values
    return out.reshape(batch, n_heads, block, head_dim).astype(queries.dtype)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _visible(block: int, n_ctx: int, delta: int, window: Optional[int], causal: bool) -> Optional[mx.array]:
    """[B, C + B] bool, True where block row i sees key j (context first); None: all visible."""
    if window is None and not causal:
        return None
    i = mx.arange(block)[:, None]
    j = mx.arange(block)[None, :]
    in_block = (j <= i) if causal else mx.ones((block, block), dtype=mx.bool_)
    if window is not None:
        in_block = in_block & (i - j < window)
    k = mx.arange(n_ctx)[None, :]
    in_ctx = (i + delta - k < window) if window is not None else mx.ones((block, n_ctx), dtype=mx.bool_)
    return mx.concatenate([in_ctx, in_block], axis=1)


def _switch_reason() -> Optional[str]:
    """``DFLASH_BLOCK_KERNEL=0`` (or off), or None.

    Raises:
        InputError: ``DFLASH_BLOCK_KERNEL`` is neither 0/off nor 1/on."""
    value = os.environ.get(ENV_VAR)
    if value is None or value.strip().lower() in _ON:
        return None
    if value.strip().lower() in _OFF:
        return f"{ENV_VAR}={value}"
    raise InputError(f"{ENV_VAR}={value!r}: expected 0/off (reference) or 1/on (kernel when possible)")


def _device_reason() -> Optional[str]:
    return ("Metal is not available (CPU backend)" if not KERNEL_AVAILABLE
            else "the default device is the CPU" if mx.default_device() != mx.gpu else None)


def _shape_reason(*arrays: mx.array) -> Optional[str]:
    """Why the kernel does not cover these inputs, or None."""
    dtypes = {x.dtype for x in arrays}
    if len(dtypes) > 1:
        return f"mixed input dtypes {sorted(str(d) for d in dtypes)}"
    if arrays[0].dtype not in _DTYPES:
        return f"dtype {arrays[0].dtype} is not float16, bfloat16 or float32"
    head_dim = arrays[0].shape[-1]
    if head_dim % 32 or not 32 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a multiple of 32 in [32, 256]"
    return None


def block_attention(queries: mx.array, ctx_keys: mx.array, ctx_values: mx.array, block_keys: mx.array,
                    block_values: mx.array, *, scale: float, window: Optional[int] = None, causal: bool = False,
                    q_start: Optional[int] = None, ctx_start: Optional[int] = None) -> mx.array:
    """Attention of the block queries over the context K/V, then the block's own K/V.

    Args:
        queries: [batch, n_heads, B, head_dim], RoPE applied, at positions ``q_start .. q_start + B - 1``.
        ctx_keys, ctx_values: [batch, n_kv_heads, C, head_dim] at positions ``ctx_start ..
            ctx_start + C - 1`` (C may be 0); slices of a preallocated cache are read in place.
        block_keys, block_values: [batch, n_kv_heads, B, head_dim] at the queries' positions.
        scale: score multiplier, usually ``head_dim ** -0.5``.
        window: sliding window W (spec section 9): position p sees keys k with ``p - k < W``; None: all.
        causal: causal in-block attention (sliding layers); context rows are always visible up to W.
        q_start, ctx_start: positions; only their difference counts. Default ``q_start = ctx_start + C``.

    Returns:
        [batch, n_heads, B, head_dim] in the queries' dtype; query head h uses KV head
        ``h // (n_heads // n_kv_heads)``; softmax statistics in float32.

    Raises:
        InputError: shapes that do not fit, ``window`` < 1, context rows overlapping the block, or an
            unknown ``DFLASH_BLOCK_KERNEL`` value."""
    arrays = (queries, ctx_keys, ctx_values, block_keys, block_values)
    _check(*arrays, window)
    delta = _relative_start(ctx_keys.shape[2], q_start, ctx_start)
    if attention_path(*arrays)["block_attention"] == "metal":
        return metal_block_attention(*arrays, scale, window, causal, delta)
    return block_attention_reference(*arrays, scale=scale, window=window, causal=causal, q_start=delta, ctx_start=0)


def attention_path(*arrays: mx.array) -> dict:
    """``{"block_attention": "metal" | "reference", "reason": str}``: the path :func:`block_attention` takes for these
    inputs (queries, ctx_keys, ctx_values, block_keys, block_values), or with none the one the environment allows.

    Raises:
        InputError: an unknown ``DFLASH_BLOCK_KERNEL`` value."""
    reason = _switch_reason() or _device_reason() or (_shape_reason(*arrays) if arrays else None)
    return {"block_attention": "reference" if reason else "metal",
            "reason": reason or f"Metal is available ({'the shape is covered' if arrays else 'shape not seen yet'})"}


def masked_attention(queries: mx.array, ctx: Tuple[mx.array, mx.array], block: Tuple[mx.array, mx.array],
                     visible: mx.array, scale: float, softmax: Callable[[mx.array], mx.array] = softmax) -> mx.array:
    """Block queries [N, n_heads, B, hd] over context keys, values ([N or 1, n_kv, L, hd]: one shared
    context broadcasts over the N blocks) and block keys, values [N, n_kv, B, hd], where ``visible``
    ([N, 1, B or 1, L + B] bool) allows. Scores in float32; returns [N, n_heads, B, hd]."""
    N, n_heads, B, hd = queries.shape
    n_kv, W = block[0].shape[1], visible.shape[-1]
    group = n_heads // n_kv
    q = (queries.astype(mx.float32) * scale).reshape(N, n_kv, group * B, hd)  # a query group shares its K/V
    scores = mx.concatenate([q @ ctx[0].astype(mx.float32).swapaxes(-1, -2),
                             q @ block[0].astype(mx.float32).swapaxes(-1, -2)], axis=-1)
    if visible.shape[2] > 1:
        visible = mx.broadcast_to(visible[:, :, None], (N, 1, group, B, W)).reshape(N, 1, group * B, W)
    weights = softmax(mx.where(visible, scores, -mx.inf)).astype(queries.dtype)
    L = ctx[0].shape[2]
    out = weights[..., :L] @ ctx[1] + weights[..., L:] @ block[1]
    return out.reshape(N, n_heads, B, hd)
