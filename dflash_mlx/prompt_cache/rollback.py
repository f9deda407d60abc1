"""Rollback: which layer caches remove their last rows exactly, and the routine that removes them."""

from typing import Any, Sequence

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..errors import RollbackError
from .drafter_context import ContextWindowCache
from .gated_delta import GatedDeltaCache
from .window import RowCache, WindowKVCache

EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, GatedDeltaCache, ContextWindowCache)  # exact, or refuses


def can_trim(c: object, n: int) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly."""
    if isinstance(c, (RowCache, GatedDeltaCache)):
        return c.can_trim(n)
    return isinstance(c, EXACT_TRIM) and 0 <= n <= c.offset


def rollback(cache: Sequence[Any], counts: Sequence[int], who: str = "layer") -> None:
    """Layer i of ``cache`` removes its last ``counts[i]`` rows, or, every layer checked first (:func:`can_trim`),
    none does.

    Raises:
        RollbackError: names the first layer (``who`` i) that cannot, or one that removed another count.
    """
    for i, (c, n) in enumerate(zip(cache, counts)):
        if not can_trim(c, n):
            raise RollbackError(f"{who} {i}: {type(c).__name__} cannot remove its last {n} rows exactly "
                                "(rows it needs were dropped or it is not trimmable)")
    for i, (c, n) in enumerate(zip(cache, counts)):
        removed = c.trim(n)
        if removed != n:
            raise RollbackError(f"{who} {i}: {type(c).__name__} trimmed {removed} of {n} rows")
