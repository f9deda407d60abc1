"""The target cache of a batch of sequences (continuous batching, ``dflash serve --max-batch``).

Each layer's cache is mlx-lm's ``BatchKVCache``: sequences are left-padded so that
they all write their next rows at one shared column, each has its own offset (RoPE
position) and its own left padding (masked). A verify feeds every sequence the same
number of rows, but each accepts its own number of drafts, so each must drop its own
number of rejected rows. mlx-lm's ``trim`` drops the same number from every sequence;
:func:`rollback_ragged` trims the fewest rejected rows from all, then moves each
sequence's remaining rejected rows out of the way by rolling its rows right and
counting the rolled-in columns as left padding: mlx-lm's own right-padding machinery
(``prepare(right_padding=...)`` then ``finalize()``), which does exactly that for
right-padded prompts. A sequence's kept rows, their positions and what its queries
see are then exactly those of a cache that never held the rejected rows.

Only targets whose every layer cache is a plain ``KVCache`` take this path
(:func:`batch_refusal` says why others do not): a sliding-window layer's
:class:`~dflash_mlx.targets.window_cache.WindowKVCache` and a Gated-DeltaNet layer's
:class:`~dflash_mlx.targets.gated_delta_cache.GatedDeltaCache` have no batched form
with per-sequence rollback here, so those targets are served one request at a time.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .hybrid import HybridAdapter


def batch_refusal(target: Any) -> Optional[str]:
    """Why ``target`` cannot decode in a batch exactly, or None when it can.

    A target can when it is not a hybrid and every layer cache mlx-lm makes for it is
    a plain ``KVCache`` (no sliding window, no recurrent state, not quantized).
    """
    if isinstance(target, HybridAdapter):
        return "Gated-DeltaNet layers (hybrid target): no per-sequence rollback of a batched recurrent state"
    for i, c in enumerate(make_prompt_cache(target.model)):
        if type(c) is not KVCache:
            return f"target layer {i} keeps a {type(c).__name__} (sliding window or other), not a plain KVCache"
    return None


def to_batch(cache: Sequence[KVCache]) -> List[BatchKVCache]:
    """One sequence's prefilled cache (a ``KVCache`` per layer) as a batch of one."""
    return [BatchKVCache.merge([c]) for c in cache]


def extend(batch: Optional[List[BatchKVCache]], cache: Sequence[KVCache]) -> List[BatchKVCache]:
    """Append one sequence (its prefilled ``KVCache`` per layer) as the batch's last row.

    Returns:
        The batch cache (``batch`` extended in place, or a new one when ``batch`` is None).
    """
    joined = to_batch(cache)
    if batch is None:
        return joined
    for b, c in zip(batch, joined):
        b.extend(c)
    return batch


def keep_rows(batch: List[BatchKVCache], rows: Sequence[int]) -> Optional[List[BatchKVCache]]:
    """Keep only the sequences at ``rows`` (in that order); None when none is left."""
    if not rows:
        return None
    index = mx.array(list(rows), dtype=mx.int32)
    for b in batch:
        b.filter(index)
    return batch


def rollback_ragged(batch: Sequence[BatchKVCache], rejected: Sequence[int]) -> None:
    """Drop the last ``rejected[i]`` rows of sequence i from every layer.

    Args:
        batch: one ``BatchKVCache`` per layer, N sequences each.
        rejected: [N] rows to drop per sequence (each 0..rows of the last forward).

    The common part is trimmed (mlx-lm's ``trim``); the rest, different per sequence,
    is rolled past the shared write column and becomes left padding (see the module
    doc). The rolled-in columns hold stale rows, masked as padding.
    """
    low = min(rejected)
    extra = [r - low for r in rejected]
    for b in batch:
        if low:
            b.trim(low)
        if any(extra):
            b.prepare(right_padding=extra)
            b.finalize()


def sequence_rows(batch: Sequence[BatchKVCache], i: int) -> List[KVCache]:
    """Sequence i's rows of every layer as a plain ``KVCache`` each (mlx-lm's ``extract``):
    what a solo run's cache would hold. For tests and checks."""
    return [b.extract(i) for b in batch]
