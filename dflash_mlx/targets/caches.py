"""Layer caches that roll back exactly, for layers whose mlx-lm cache cannot, and their
one trim contract (:func:`can_trim`, :data:`EXACT_TRIM`). One file per cache kind; every
name is importable from here:

- :class:`~dflash_mlx.targets.window_cache.WindowKVCache`, for a target's sliding-window
  attention (mlx-lm's ``RotatingKVCache`` cannot be trimmed once it wraps).
- :class:`~dflash_mlx.targets.gated_delta_cache.GatedDeltaCache`, for Gated-DeltaNet layers
  (hybrid targets): replays the accepted prefix of the last forward (DFLASH_SPEC.md section 10).
- :class:`~dflash_mlx.targets.context_cache.ContextWindowCache`, for the drafter's context: a
  sink of first rows plus a window of recent rows (sliding drafter layers, ``--draft-window``).
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .context_cache import ContextWindowCache
from .gated_delta_cache import GatedDeltaCache
from .window_cache import WindowKVCache

__all__ = ["EXACT_TRIM", "ContextWindowCache", "GatedDeltaCache", "WindowKVCache", "can_trim"]


EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, GatedDeltaCache, ContextWindowCache)  # trim() is exact or refuses


def can_trim(c: object, n: int) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly."""
    if isinstance(c, (WindowKVCache, GatedDeltaCache, ContextWindowCache)):
        return c.can_trim(n)
    return isinstance(c, EXACT_TRIM) and 0 <= n <= c.offset
