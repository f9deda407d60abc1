"""The one trim contract of layer caches: which caches remove their last rows exactly."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .drafter_context import ContextWindowCache
from .gated_delta import GatedDeltaCache
from .window import WindowKVCache

EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, GatedDeltaCache, ContextWindowCache)  # trim() is exact or refuses


def can_trim(c: object, n: int) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly."""
    if isinstance(c, (WindowKVCache, GatedDeltaCache, ContextWindowCache)):
        return c.can_trim(n)
    return isinstance(c, EXACT_TRIM) and 0 <= n <= c.offset
