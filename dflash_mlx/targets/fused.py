"""Fused RMSNorm, RoPE and masks for a target on MLX's CPU backend: fewer ops per step, same bits.

On the CPU backend ``mx.fast.rms_norm`` and ``mx.fast.rope`` have no kernel of their
own: each call is built from its composed fallback (some 6 and 20 small ops), and at
a few tokens per forward each op is a task handed to the stream's thread, so a
small target's verify and plain step cost their op count more than their flops.
Here (stories260K, ops per 16-token verify: 776 as mlx-lm builds it, 389 here):

- RMSNorm: the fallback's formula under ``mx.compile`` (which fuses its element-wise
  ops), the mean's ``1/n`` a constant.
- RoPE: the cosines and sines come from a table of positions kept per RoPE
  configuration (computed by ``mx.fast.rope`` itself, see :class:`_Tables`), sliced
  once per forward for all layers; the rotation is one compiled element-wise kernel
  (:func:`_rotate`). The drafter's compiled step uses the same tables
  (:func:`rope_rows`, :func:`rotate`).
- Masks (:func:`attention_mask`): a boolean array built once per forward instead of
  ``"causal"``, which each layer's attention builds again.

Each gives the same bits as mlx-lm's forward (``tests/test_fused_layers.py``: every
family, float32, bfloat16 and float16), so greedy output does not change.

:func:`fuse_layers` swaps the class of every ``nn.RMSNorm`` and ``nn.RoPE`` in a
model (those exact classes only: a family's own norm, such as Gemma's ``1 + w``, or
a scaled RoPE, is left alone) for a subclass computing the same result. Weights,
attributes and the parameter tree stay as loaded. On a GPU default device, where
each is a single Metal kernel, and with ``DFLASH_COMPILE=0``, nothing is swapped.
:func:`unfused` swaps them back for a while, for baselines that must run mlx-lm's
model exactly as mlx-lm loads it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

COMPILE_ENV = "DFLASH_COMPILE"
# The rotation is compiled per input shape (its slices cannot be traced shapeless), so
# only short inputs (verify blocks, plain and batched steps) take the fused path and
# array masks: a bounded number of traces; a prefill chunk is compute, not op count.
MAX_FUSED_ROPE_TOKENS = 64


@lru_cache(maxsize=None)
def _rms_norm_kernel(dims: int, eps: float, out_type: mx.Dtype) -> Callable:
    """``mx.fast.rms_norm``'s CPU fallback over ``dims`` features, compiled: float32
    ``x * rsqrt(mean(x**2) + eps)``, cast to ``out_type``, times the weight. The mean's
    ``1/dims`` is a constant here (the fallback computes it in an op of its own, as
    ``float32(1.0 / dims)``, the same value)."""
    inverse, eps = mx.array(1.0 / dims, dtype=mx.float32), mx.array(eps, dtype=mx.float32)

    def rms_norm(x: mx.array, weight: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        x = x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inverse + eps)
        return x.astype(out_type) * weight.astype(out_type)

    return mx.compile(rms_norm, shapeless=True)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """``mx.fast.rope``'s CPU fallback rotation, as one element-wise kernel.

    The fallback computes ``x1 * cos - x2 * sin`` and ``x1 * sin + x2 * cos`` for the
    two halves (or the even and odd entries) of the rotated dims. Here ``x`` and its
    halves swapped are multiplied by ``cos = [c, c]`` and ``sin = [-s, s]`` and added:
    ``a - b`` is ``a + (-b)`` and ``x * -s`` is ``-(x * s)`` in IEEE arithmetic, so
    every entry has the same bits, with one kernel instead of slices, two kernels
    and a concatenation.
    """
    shape = x.shape
    pairs = (*shape[:-1], shape[-1] // 2, 2) if traditional else (*shape[:-1], 2, shape[-1] // 2)
    swapped = x.reshape(pairs)[..., ::-1] if traditional else x.reshape(pairs)[..., ::-1, :]
    return x * cos + swapped.reshape(shape) * sin


_rotate_kernel = mx.compile(_rotate)  # traced once per input shape (few: at most MAX_FUSED_ROPE_TOKENS)

# Positions below 2**24 are exact in float32, where the fallback computes them, so a
# table row at position p has the bits of a forward at offset p. Tables stop at 16K
# positions (cos and sin: 8 MB per 64 rotated dims in float32); past them each forward
# computes its own rows once, for all layers.
MAX_TABLE_POSITIONS = 1 << 14


class _Tables:
    """The ``(cos, sin)`` tables of one RoPE configuration and dtype, as :func:`_rotate`
    takes them: rows for positions ``0..P-1`` (P grown by doubling up to
    :data:`MAX_TABLE_POSITIONS`), and the rows of the last forward (every layer of a
    forward rotates by the same positions)."""

    def __init__(self, dims: int, traditional: bool, base: float, scale: float, dtype: mx.Dtype):
        self.dims, self.traditional, self.base, self.scale, self.dtype = dims, traditional, base, scale, dtype
        self.cos = self.sin = None
        self.recent = {}  # (tokens, int offset) -> rows of the last forwards (a drafter step has two)
        self.last = None  # (tokens, offset array, rows): the last forward's, for per-sequence offsets
        self._per_forward = mx.compile(self._compute)

    def _compute(self, positions: int, offset: mx.array):
        """[B, 1, positions, dims] cos and sin from ``mx.fast.rope`` itself: on an input
        whose first halves (or even entries) are 1 and the others 0, it returns exactly
        the cosines and the sines it rotates by."""
        dims, half = self.dims, self.dims // 2
        one, zero = mx.ones((half,), dtype=self.dtype), mx.zeros((half,), dtype=self.dtype)
        unit = mx.stack([one, zero], axis=-1).reshape(dims) if self.traditional else mx.concatenate([one, zero])
        x = mx.broadcast_to(unit, (offset.size, 1, positions, dims))
        t = mx.fast.rope(x, dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        if self.traditional:
            c, s = t[..., 0::2], t[..., 1::2]
            return mx.stack([c, c], axis=-1).reshape(t.shape), mx.stack([-s, s], axis=-1).reshape(t.shape)
        c, s = t[..., :half], t[..., half:]
        return mx.concatenate([c, c], axis=-1), mx.concatenate([-s, s], axis=-1)

    def rows(self, tokens: int, offset: Union[int, mx.array]) -> Tuple[mx.array, mx.array]:
        """cos and sin [1 or B, 1, tokens, dims] for ``tokens`` positions from ``offset``
        (an int, or an int array with one offset per sequence)."""
        if isinstance(offset, mx.array):
            last = self.last
            if last is not None and last[0] == tokens and last[1] is offset:
                return last[2]
            rows = self._per_forward(tokens, offset.reshape(-1))
            self.last = (tokens, offset, rows)
            return rows
        hit = self.recent.get((tokens, offset))
        if hit is not None:
            return hit
        if len(self.recent) >= 4:
            self.recent.clear()
        end = offset + tokens
        if offset < 0 or end > MAX_TABLE_POSITIONS:
            rows = self._per_forward(tokens, mx.array([offset], dtype=mx.int32))
        else:
            if self.cos is None or self.cos.shape[-2] < end:
                size = min(max(256, 1 << (end - 1).bit_length()), MAX_TABLE_POSITIONS)
                self.cos, self.sin = self._compute(size, mx.array([0], dtype=mx.int32))
                mx.eval(self.cos, self.sin)
            rows = self.cos[..., offset:end, :], self.sin[..., offset:end, :]
        self.recent[(tokens, offset)] = rows
        return rows


_TABLES: dict = {}  # (dims, traditional, base, scale, dtype) -> _Tables


def _tables(rope: nn.RoPE, dtype: mx.Dtype) -> _Tables:
    key = (rope.dims, rope.traditional, rope.base, rope.scale, dtype)
    tables = _TABLES.get(key)
    if tables is None:
        tables = _TABLES[key] = _Tables(*key)
    return tables


def rope_rows(rope: nn.Module, tokens: int, offset: int) -> Optional[Tuple[mx.array, mx.array]]:
    """float32 ``(cos, sin)`` [1, 1, tokens, dims] for :func:`rotate`, where layers are
    fused and ``rope`` is an exact ``nn.RoPE`` (the drafter's compiled step takes them
    as inputs); None otherwise (use ``rope`` itself)."""
    if type(rope) not in (nn.RoPE, FusedRoPE) or not fused_layers_enabled():
        return None
    return _tables(rope, mx.float32).rows(tokens, offset)


def rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """``mx.fast.rope(x, ...)`` with :func:`rope_rows`' tables, as the CPU computes it
    (same bits: the fallback rounds its float32 cosines and sines to ``x``'s dtype
    first, as here). ``x``: [..., tokens, dims]. Traceable by ``mx.compile``."""
    return _rotate(x, cos.astype(x.dtype), sin.astype(x.dtype), traditional)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by one compiled kernel (same weights, same result)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        return _rms_norm_kernel(x.shape[-1], self.eps, mx.result_type(x.dtype, weight.dtype))(x, weight)


class FusedRoPE(nn.RoPE):
    """``nn.RoPE`` for inputs of at most :data:`MAX_FUSED_ROPE_TOKENS` tokens: the
    cosines and sines computed once per forward (shared by every layer's queries and
    keys), the rotation by one compiled kernel (same result as ``mx.fast.rope``).

    ``offset`` is an int or an int array (one per sequence in a batch), as for ``nn.RoPE``.
    Longer inputs and a RoPE over part of the head (``dims`` < head size) run ``nn.RoPE``.
    """

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        if x.shape[-2] > MAX_FUSED_ROPE_TOKENS or self.dims != x.shape[-1]:
            return super().__call__(x, offset)
        cos, sin = _tables(self, x.dtype).rows(x.shape[-2], offset)
        if x.ndim != 4:  # rows are [B, 1, T, dims]: one per sequence, broadcast over heads
            cos, sin = (a.reshape(a.shape[0], *[1] * (x.ndim - 3), *a.shape[2:]) for a in (cos, sin))
        return _rotate_kernel(x, cos, sin, self.traditional)


def attention_mask(h: mx.array, cache, window_size: Optional[int] = None):
    """mlx-lm's ``create_attention_mask``, as an array for a short input where layers are
    fused: on the CPU, ``"causal"`` makes every layer's attention build the same
    boolean mask again (six ops each); the array is built once per forward and
    selects the same entries, so the scores are the same bits.

    Args:
        h: [B, L, H] the layers' input (L tokens).
        cache: the layer's cache, or None.

    Returns:
        None (one token), ``"causal"``, or a boolean array as mlx-lm makes it.
    """
    short = 1 < h.shape[1] <= MAX_FUSED_ROPE_TOKENS
    return create_attention_mask(h, cache, window_size=window_size, return_array=short and fused_layers_enabled())


def compile_enabled() -> bool:
    """Whether ``mx.compile`` is used: of the target's norms and RoPE here, and of the
    drafter's inference step (:mod:`dflash_mlx.drafter.network`). ``DFLASH_COMPILE=0``
    (or off, false, no) turns both off."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def fused_layers_enabled() -> bool:
    """True where :func:`fuse_layers` swaps: the default device is the CPU and
    :func:`compile_enabled`."""
    return mx.default_device() == mx.cpu and compile_enabled()


def fuse_layers(model: nn.Module) -> int:
    """Swap every ``nn.RMSNorm`` / ``nn.RoPE`` of ``model`` (exact classes) for its
    fused subclass, in place, where :func:`fused_layers_enabled`.

    Returns:
        how many modules were swapped (0 where disabled).
    """
    if not fused_layers_enabled():
        return 0
    swaps = {nn.RMSNorm: FusedRMSNorm, nn.RoPE: FusedRoPE}
    count = 0
    for module in model.modules():
        fused = swaps.get(type(module))
        if fused is not None:
            module.__class__ = fused
            count += 1
    return count


@contextmanager
def unfused(*models: nn.Module) -> Iterator[None]:
    """Run ``models`` with mlx-lm's own ``nn.RMSNorm`` / ``nn.RoPE`` inside the block
    (a baseline timed as mlx-lm runs the model), then with the fused ones again."""
    back = {FusedRMSNorm: nn.RMSNorm, FusedRoPE: nn.RoPE}
    swapped = [(m, type(m)) for model in models for m in model.modules() if type(m) in back]
    for m, fused in swapped:
        m.__class__ = back[fused]
    try:
        yield
    finally:
        for m, fused in swapped:
            m.__class__ = fused
