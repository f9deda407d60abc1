"""Rollback: which layer caches remove their last rows exactly, and :func:`rollback`, the one routine that removes
them from every cache kind here (KV, quantized, sliding-window, Gated-DeltaNet, the drafter's context), of one
sequence or, per sequence, of a batch. A tree's accepted path is not a prefix of its inputs, so
``TreeVerify.compact`` moves the path's rows after calling it; a batch's ``compact`` drops padding, no rows."""

from typing import Any, Dict, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from ..errors import RollbackError
from .batch import BatchGatedDeltaCache, RaggedRoll, common_padding
from .drafter_context import ContextWindowCache
from .gated_delta import GatedDeltaCache
from .window import RowCache, WindowKVCache

EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, GatedDeltaCache, ContextWindowCache)  # exact, or refuses
Count = Union[int, Sequence[int]]  # rows a layer removes: an int or [1] (one sequence), [N] per sequence (a batch)


def can_trim(c: object, n: Count) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly; a batched layer, sequence i its last ``n[i]``
    (``BatchKVCache``, ``BatchWindowKVCache``: rows it holds; ``BatchGatedDeltaCache``: within its last forward)."""
    rows = list(n) if isinstance(n, (list, tuple)) else [n]
    if isinstance(c, BatchGatedDeltaCache):
        return all(map(c.can_trim, rows))
    if isinstance(c, BatchKVCache):
        return all(0 <= r <= c._idx for r in rows)
    if len(rows) != 1:
        return False
    if isinstance(c, (RowCache, GatedDeltaCache)):
        return c.can_trim(rows[0])
    return isinstance(c, EXACT_TRIM) and 0 <= rows[0] <= c.offset


def rollback(cache: Sequence[Any], counts: Sequence[Count], who: str = "layer") -> None:
    """Layer i of ``cache`` removes its last ``counts[i]`` rows, or, every layer checked first (:func:`can_trim`),
    none does (nor is anything checked where no count is positive). A batched layer trims every sequence's fewest
    and rolls the rest of sequence j's ``counts[i][j]`` into its left padding; a ``BatchGatedDeltaCache`` replays
    its last forward per sequence. Layers whose sequences remove different counts are evaluated before it
    returns (their rows move: the copies cost this step).

    Raises:
        RollbackError: names the first layer (``who`` i) that cannot, or one that removed another count.
    """
    rows = [list(n) if isinstance(n, (list, tuple)) else [n] for n in counts]
    if not any(r > 0 for n in rows for r in n):
        return
    for i, (c, n) in enumerate(zip(cache, rows)):
        if not can_trim(c, n):
            raise RollbackError(f"{who} {i}: {type(c).__name__} cannot remove its last {counts[i]} rows exactly "
                                "(rows it needs were dropped or it is not trimmable)")
    rolls: Dict[tuple, RaggedRoll] = {}  # a batch's full-attention layers share one column layout: one roll
    for i, (c, n) in enumerate(zip(cache, rows)):
        if isinstance(c, BatchGatedDeltaCache):
            c.trim_ragged(n)
            continue
        low = min(n)
        extra = tuple(r - low for r in n)
        removed = c.trim(low) if low else 0
        if removed != low:
            raise RollbackError(f"{who} {i}: {type(c).__name__} trimmed {removed} of {low} rows")
        if any(extra) and type(c) is BatchKVCache:
            rolls[extra] = rolls.get(extra) or RaggedRoll(extra, common_padding(c, extra))
            rolls[extra](c)
        elif any(extra):  # window layers: their padding is dropped by compact(), after hide_old_rows
            c.prepare(right_padding=list(extra))
            c.finalize()
    mx.eval([c.state for c, n in zip(cache, rows) if len(set(n)) > 1])  # rows moved here, timed with this step
