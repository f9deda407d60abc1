"""Fused RMSNorm, RoPE and attention masks for a target on MLX's CPU backend: fewer ops, the same bits
as mlx-lm's forward (every family, float32, bfloat16 and float16)."""

import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

COMPILE_ENV = "DFLASH_COMPILE"
MAX_FUSED_ROPE_TOKENS = 64  # longer inputs run mlx-lm's RoPE and masks (the rotation is traced per shape)


@lru_cache(maxsize=None)
def _rms_norm_kernel(dims: int, eps: float, out_type: mx.Dtype) -> Callable:
    """``mx.fast.rms_norm``'s CPU fallback over ``dims`` features, compiled (same bits)."""
    inverse, eps = mx.array(1.0 / dims, dtype=mx.float32), mx.array(eps, dtype=mx.float32)

    def rms_norm(x: mx.array, weight: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        x = x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inverse + eps)
        return x.astype(out_type) * weight.astype(out_type)

    return mx.compile(rms_norm, shapeless=True)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """``mx.fast.rope``'s CPU fallback rotation as ``x * [c, c] + swap(x) * [-s, s]`` (same bits)."""
    shape = x.shape
    pairs = (*shape[:-1], shape[-1] // 2, 2) if traditional else (*shape[:-1], 2, shape[-1] // 2)
    swapped = x.reshape(pairs)[..., ::-1] if traditional else x.reshape(pairs)[..., ::-1, :]
    return x * cos + swapped.reshape(shape) * sin


_rotate_kernel = mx.compile(_rotate)
MAX_TABLE_POSITIONS = 1 << 14  # past these, each forward computes its own rows


class _Tables:
    """The ``(cos, sin)`` rows of one RoPE configuration and dtype for :func:`_rotate`: a table of
    positions ``0..P-1`` (P doubling up to :data:`MAX_TABLE_POSITIONS`) and the last forwards' rows."""

    def __init__(self, dims: int, traditional: bool, base: float, scale: float, dtype: mx.Dtype):
        self.dims, self.traditional, self.base, self.scale, self.dtype = dims, traditional, base, scale, dtype
        self.cos = self.sin = None
        self.recent = {}  # (tokens, int offset) -> rows of the last forwards (a drafter step has two)
        self.last = None  # (tokens, offset array, rows): the last forward's, for per-sequence offsets
        self._per_forward = mx.compile(self._compute)

    def _compute(self, positions: int, offset: mx.array):
        """[B, 1, positions, dims] cos and sin, from ``mx.fast.rope`` of a unit input."""
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
        if (hit := self.recent.get((tokens, offset))) is not None:
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


_tables_of = lru_cache(maxsize=None)(_Tables)  # one per (dims, traditional, base, scale, dtype)


def _tables(rope: nn.RoPE, dtype: mx.Dtype) -> _Tables:
    return _tables_of(rope.dims, rope.traditional, rope.base, rope.scale, dtype)


def rope_rows(rope: nn.Module, tokens: int, offset: int) -> Optional[Tuple[mx.array, mx.array]]:
    """float32 ``(cos, sin)`` [1, 1, tokens, dims] for :func:`rotate`, where layers are fused and
    ``rope`` is an exact ``nn.RoPE``; None otherwise."""
    if type(rope) not in (nn.RoPE, FusedRoPE) or not fused_layers_enabled():
        return None
    return _tables(rope, mx.float32).rows(tokens, offset)


def rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """``mx.fast.rope`` of ``x`` [..., tokens, dims] from :func:`rope_rows`' rows (same bits; traceable)."""
    return _rotate(x, cos.astype(x.dtype), sin.astype(x.dtype), traditional)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` as one compiled kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        return _rms_norm_kernel(x.shape[-1], self.eps, mx.result_type(x.dtype, weight.dtype))(x, weight)


class FusedRoPE(nn.RoPE):
    """``nn.RoPE`` with rows shared by a forward's layers and one compiled rotation, for inputs of
    at most :data:`MAX_FUSED_ROPE_TOKENS` tokens over the whole head; ``offset`` int or [B] array."""

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        if x.shape[-2] > MAX_FUSED_ROPE_TOKENS or self.dims != x.shape[-1]:
            return super().__call__(x, offset)
        cos, sin = _tables(self, x.dtype).rows(x.shape[-2], offset)
        if x.ndim != 4:  # rows are [B, 1, T, dims]: one per sequence, broadcast over heads
            cos, sin = (a.reshape(a.shape[0], *[1] * (x.ndim - 3), *a.shape[2:]) for a in (cos, sin))
        return _rotate_kernel(x, cos, sin, self.traditional)


def attention_mask(h: mx.array, cache, window_size: Optional[int] = None):
    """mlx-lm's ``create_attention_mask`` for ``h`` [B, L, H], as a boolean array (built once per
    forward) for a short input where layers are fused; None, ``"causal"`` or the array."""
    short = 1 < h.shape[1] <= MAX_FUSED_ROPE_TOKENS
    return create_attention_mask(h, cache, window_size=window_size, return_array=short and fused_layers_enabled())


class FusedLinear(nn.Linear):
    """``nn.Linear`` with its weight's transpose made once, as views (:meth:`keep_transpose`): the same matmul and
    bits, one graph node fewer per call, three for one sequence's rows [1, T, in] (against the [1, in, out] view:
    no flatten and unflatten around the matmul); the weight replaced, it transposes per call again."""

    def keep_transpose(self) -> None:
        """Evaluate ``weight.T`` and ``weight.T[None]`` (strided views of the weight, no copy) for the calls to come."""
        kept = (self["weight"], self["weight"].T, self["weight"].T[None])
        mx.eval(kept)
        object.__setattr__(self, "_transposed", kept)

    def __call__(self, x: mx.array) -> mx.array:
        weight, kept = self["weight"], self.__dict__.get("_transposed")
        if kept is not None and kept[0] is not weight:  # replaced: let the old weight go
            kept = self.__dict__["_transposed"] = None
        transposed = weight.T if kept is None else kept[2] if x.ndim == 3 and x.shape[0] == 1 else kept[1]
        return mx.addmm(self["bias"], x, transposed) if "bias" in self else x @ transposed


def compile_enabled() -> bool:
    """Whether ``mx.compile`` is used here and in the drafter; ``DFLASH_COMPILE=0`` (off, false, no): not."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def fused_layers_enabled() -> bool:
    """Whether :func:`fuse_layers` swaps: the default device is the CPU and :func:`compile_enabled`."""
    return mx.default_device() == mx.cpu and compile_enabled()


def fuse_layers(model: nn.Module) -> int:
    """Swap the class of every exact ``nn.RMSNorm`` / ``nn.RoPE`` / ``nn.Linear`` of ``model`` for its fused
    subclass where :func:`fused_layers_enabled`, and keep each fused linear's transpose (again, after its
    weights were replaced); returns how many were swapped."""
    if not fused_layers_enabled():
        return 0
    swaps = {nn.RMSNorm: FusedRMSNorm, nn.RoPE: FusedRoPE, nn.Linear: FusedLinear}
    count = 0
    for module in model.modules():
        if (fused := swaps.get(type(module))) is not None:
            module.__class__ = fused
            count += 1
        if type(module) is FusedLinear:
            module.keep_transpose()
    return count


@contextmanager
def unfused(*models: nn.Module) -> Iterator[None]:
    """Run ``models`` with mlx-lm's own ``nn.RMSNorm`` / ``nn.RoPE`` / ``nn.Linear`` inside the block."""
    back = {FusedRMSNorm: nn.RMSNorm, FusedRoPE: nn.RoPE, FusedLinear: nn.Linear}
    swapped = [(m, type(m)) for model in models for m in model.modules() if type(m) in back]
    for m, fused in swapped:
        m.__class__ = back[fused]
    try:
        yield
    finally:
        for m, fused in swapped:
            m.__class__ = fused
