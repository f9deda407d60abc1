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

A Gated-DeltaNet layer (hybrid targets) has no rows: its batched cache is a
:class:`~dflash_mlx.prompt_cache.batch_gated_delta.BatchGatedDeltaCache`, which replays
each sequence's kept prefix. A sliding-window layer (a
:class:`~dflash_mlx.prompt_cache.window.WindowKVCache` alone) is a
:class:`~dflash_mlx.prompt_cache.batch_window.BatchWindowKVCache`: a ``BatchKVCache``
rolled back as above, the window applied by its mask, rows out of every window
dropped with the padding (:func:`compact`). So every target family batches;
:func:`batch_refusal` names a layer cache of any other kind.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .batch_gated_delta import BatchGatedDeltaCache
from .batch_window import BatchWindowKVCache
from .gated_delta import GatedDeltaCache
from .window import WindowKVCache

BATCHABLE = (KVCache, GatedDeltaCache, WindowKVCache)  # layer cache types with a batched form


def batch_refusal(target: Any) -> Optional[str]:
    """Why ``target`` cannot decode in a batch exactly, or None when it can.

    A target can when every layer cache it makes (``target.make_cache``) is a plain
    ``KVCache``, a Gated-DeltaNet layer's ``GatedDeltaCache`` or a sliding-window
    layer's ``WindowKVCache``: every family here.
    """
    for i, c in enumerate(target.make_cache(1)):
        if type(c) not in BATCHABLE:
            return f"target layer {i} keeps a {type(c).__name__}, which has no batched form with per-sequence rollback"
    return None


def to_batch(cache: Sequence[Any]) -> List[Any]:
    """One sequence's prefilled cache (a ``KVCache``, ``GatedDeltaCache`` or
    ``WindowKVCache`` per layer) as a batch of one."""
    return [_batch_layer(c) for c in cache]


def _batch_layer(c: Any) -> Any:
    """One layer's solo cache as the batched cache of its kind, a batch of one."""
    if isinstance(c, GatedDeltaCache):
        return BatchGatedDeltaCache(c)
    if isinstance(c, WindowKVCache):
        return BatchWindowKVCache.from_solo(c)
    return BatchKVCache.merge([c])


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
    doc). The rolled-in columns hold stale rows, masked as padding. In full-attention
    layers the same roll also drops the padding every sequence then has
    (:class:`RaggedRoll`), so their columns are the longest sequence's rows.
    """
    low = min(rejected)
    extra = [r - low for r in rejected]
    roll = None  # full-attention layers share one column layout: one roll for all
    for b in batch:
        if isinstance(b, BatchGatedDeltaCache):
            b.trim_ragged(rejected)
            continue
        if low:
            b.trim(low)
        if not any(extra):
            continue
        if type(b) is BatchKVCache:
            roll = roll or RaggedRoll(extra, common_padding(b, extra))
            roll(b)
        else:  # window layers: their padding is dropped by compact(), after hide_old_rows
            b.prepare(right_padding=extra)
            b.finalize()


def common_padding(b: BatchKVCache, right: Sequence[int]) -> int:
    """Columns of left padding every sequence of ``b`` has once its last ``right[i]``
    rows are rolled into its padding (one small host read)."""
    return min(p + r for p, r in zip(b.left_padding.tolist(), right))


class RaggedRoll:
    """Roll sequence i's rows right by ``right[i]`` columns, its last ``right[i]`` rows
    becoming left padding (mlx-lm's ``prepare(right_padding=...)`` then ``finalize()``),
    and drop the first ``drop`` columns, padding in every sequence (``drop <=
    common_padding(b, right)``; as mlx-lm's ``filter`` does): one gather of the keys and
    one of the values per layer, called on each layer of one column layout.

    Why not mlx-lm's two steps: on a CPU a step's attention costs about one exp per
    cached column, and the padding every sequence has would otherwise stay until
    :func:`compact` copies the cache again; and a small model's step costs about its
    number of ops, so the gather's index is built once for all layers, not per array.

    Args:
        right: [N] columns to roll each sequence by.
        drop: columns to drop from the left.
    """

    def __init__(self, right: Sequence[int], drop: int = 0):
        self.right, self.drop = mx.array(list(right)), drop
        self._shift = (self.right - drop)[:, None, None, None]
        self._index = {}  # columns of the buffer -> [N, 1, columns, 1] gather index

    def __call__(self, b: BatchKVCache) -> None:
        n = b.keys.shape[2]
        index = self._index.get(n)
        if index is None:
            index = self._index[n] = (mx.arange(n)[:, None] - self._shift) % n
        b.keys = mx.take_along_axis(b.keys, index, axis=2)
        b.values = mx.take_along_axis(b.values, index, axis=2)
        b.offset = b.offset - self.right
        b.left_padding = b.left_padding + self._shift.reshape(-1)
        b._idx -= self.drop


def share_offsets(batch: Sequence[Any]) -> None:
    """Make the full-attention layers' offsets one array object for the next forward.

    Their values are equal (one column layout), and the fused RoPE computes its tables
    once per offset object (:class:`~dflash_mlx.targets.fused.FusedRoPE`): shared, once
    per forward instead of once per layer (about 15 ops each). Safe because between this
    call and a layer's ``update_and_fetch`` the layer only reads its offset (RoPE), and
    ``update_and_fetch`` gives it a new array: mlx-lm's ``BatchKVCache`` replaces its
    offset, never updates it in place (checked against the installed mlx-lm by
    ``tests/test_batch_decode.py``).
    """
    full = [b for b in batch or () if type(b) is BatchKVCache]
    for b in full[1:]:
        b.offset = full[0].offset


def sequence_rows(batch: Sequence[BatchKVCache], i: int) -> List[KVCache]:
    """Sequence i's rows of every layer as a plain ``KVCache`` each (mlx-lm's ``extract``;
    an ``ArraysCache`` of its states for a Gated-DeltaNet layer): what a solo run's cache
    would hold. For tests and checks."""
    return [b.extract(i) for b in batch]


COMPACT_AT = 32  # columns of padding every sequence has before they are dropped (a copy of the cache)


def compact(batch: Optional[Sequence[Any]], at_least: int = COMPACT_AT) -> None:
    """Drop the padding columns every sequence has (ragged rollbacks add padding to all
    but the sequence that kept the most rows; over steps each sequence gets some), once
    there are ``at_least`` of them: mlx-lm's ``filter`` keeping every row shifts them
    out. Attention then reads fewer padded columns. Sliding-window layers first count
    the rows out of every window as padding (``hide_old_rows``), so they keep about
    W - 1 + ``at_least`` columns. Gated-DeltaNet layers have none.
    """
    layers = [b for b in batch or () if isinstance(b, BatchKVCache) and b.keys is not None]
    for b in layers:
        if isinstance(b, BatchWindowKVCache):
            b.hide_old_rows()
    # Full and window layers each share one column layout (the same ops on each).
    for group in ([b for b in layers if not isinstance(b, BatchWindowKVCache)],
                  [b for b in layers if isinstance(b, BatchWindowKVCache)]):
        if group and min(group[0].left_padding.tolist()) >= at_least:
            keep = mx.arange(len(group[0].left_padding))
            for b in group:
                b.filter(keep)
