"""Fused RMSNorm and RoPE for a target on MLX's CPU backend: fewer ops per step, same bits.

On the CPU backend ``mx.fast.rms_norm`` and ``mx.fast.rope`` have no kernel of their
own: each call is built from its composed fallback (some 6 and 20 small ops), and at
a few tokens per forward each op is a task handed to the stream's thread, so a
small target's verify and plain step cost their op count more than their flops
(stories260K: 776 ops per 16-token verify, 529 with these two fused). ``mx.compile``
fuses each fallback's element-wise ops into one kernel. The compiled result equals
the uncompiled one bit for bit (``tests/test_fused_layers.py``, float32, bfloat16
and float16), so greedy output does not change.

:func:`fuse_layers` swaps the class of every ``nn.RMSNorm`` and ``nn.RoPE`` in a
model (those exact classes only: a family's own norm, such as Gemma's ``1 + w``, or
a scaled RoPE, is left alone) for a subclass whose ``__call__`` runs the same
``mx.fast`` call compiled. Weights, attributes and the parameter tree stay as
loaded. On a GPU default device, where both are single Metal kernels, and with
``DFLASH_COMPILE=0``, nothing is swapped. :func:`unfused` swaps them back for a while,
for baselines that must run mlx-lm's model exactly as mlx-lm loads it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache, partial
from typing import Callable, Iterator, Union

import mlx.core as mx
import mlx.nn as nn

COMPILE_ENV = "DFLASH_COMPILE"
# RoPE is compiled per input shape (its fallback slices cannot be traced shapeless),
# so only short inputs (verify blocks, plain and batched steps) take the fused path:
# a bounded number of traces; a prefill chunk is compute, not op count.
MAX_FUSED_ROPE_TOKENS = 64


@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


@lru_cache(maxsize=None)
def _rope_kernel(dims: int, traditional: bool, base: float, scale: float) -> Callable:
    def rope(x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    return mx.compile(rope)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by one compiled kernel (same weights, same result)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(x, self["weight"], self.eps)


class FusedRoPE(nn.RoPE):
    """``nn.RoPE`` computed by one compiled kernel for inputs of at most
    :data:`MAX_FUSED_ROPE_TOKENS` tokens (same result).

    ``offset`` is an int or an int array (one per sequence in a batch), as for ``nn.RoPE``.
    """

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        if x.shape[-2] > MAX_FUSED_ROPE_TOKENS:
            return super().__call__(x, offset)
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        return _rope_kernel(self.dims, self.traditional, self.base, self.scale)(x, offset)


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
