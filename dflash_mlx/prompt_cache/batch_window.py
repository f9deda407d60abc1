"""The sliding-window attention layer cache of a batch of sequences, with per-sequence rollback.

One sequence decodes with a :class:`~dflash_mlx.prompt_cache.window.WindowKVCache`. In a
batch, a window layer's cache is mlx-lm's ``BatchKVCache`` (:class:`BatchWindowKVCache`):
the same left-padded rows, shared write column, per-sequence offsets and ragged rollback
(:func:`~dflash_mlx.prompt_cache.batch.rollback_ragged`) as a full-attention layer. The
window is applied by the mask alone: mlx-lm's ``BatchKVCache.make_mask(N, window_size=W)``
lets the query in column q see key columns ``q - W < k <= q`` not in its left padding.
Each sequence's rows are contiguous and end at the shared write column (appends,
``trim`` and the right roll of a ragged rollback keep them so), so column distances are
position distances: per sequence, exactly the solo window ``p - W < k <= p``.

Rows no future query can see (more than ``W - 1`` columns before the write column,
between steps) are counted as left padding by :meth:`BatchWindowKVCache.hide_old_rows`,
and :func:`~dflash_mlx.prompt_cache.batch.compact` drops them with the other padding:
between steps a window layer of a batch is under ``W - 1 + COMPACT_AT`` columns wide
(plus one verify's rows during a forward), not the whole context.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .window import WindowKVCache


class BatchWindowKVCache(BatchKVCache):
    """A ``BatchKVCache`` of a sliding-window layer (window ``W``).

    Args:
        window: W, the layer's sliding window in tokens.
        left_padding: [N] columns of padding per sequence.

    Attributes:
        keys, values: [N, n_kv_heads, capacity, head_dim]; sequence i's rows are
            columns ``left_padding[i] .. _idx-1``, its last row at ``_idx - 1``.
        offset: [N] each sequence's absolute position after its last row (its RoPE
            offset); may exceed ``_idx - left_padding`` once old rows are dropped.
    """

    def __init__(self, window: int, left_padding: list):
        super().__init__(left_padding)
        self.window = int(window)

    @classmethod
    def from_solo(cls, solo: WindowKVCache) -> "BatchWindowKVCache":
        """One sequence's prefilled window cache as a batch of one: its held rows
        (positions ``start..offset-1``), offset ``solo.offset``, no padding."""
        batch = cls(solo.window, [0])
        if solo.keys is not None:
            keys, values = solo.rows()
            batch.keys, batch.values = mx.contiguous(keys), mx.contiguous(values)
            batch._idx = solo.held
        batch.offset = mx.array([solo.offset])
        return batch

    def make_mask(self, N: int, window_size: Optional[int] = None, **kwargs) -> mx.array:
        """[B, 1, N, _idx + N] bool for B sequences and N new queries: causal, windowed,
        padding hidden (mlx-lm's ``BatchKVCache`` mask, this layer's window unless given)."""
        # mlx-lm's mask is in columns, which are positions per sequence here (module doc);
        # the families pass window_size themselves, the default covers a caller that does not.
        return super().make_mask(N, window_size=window_size or self.window, **kwargs)

    def hide_old_rows(self) -> None:
        """Count as padding the columns before ``_idx - (W - 1)``: between steps, the next
        forward's first query is at column ``_idx`` or later (a rollback never drops a
        row of an earlier forward), so no query sees them."""
        if self.keys is not None:
            self.left_padding = mx.maximum(self.left_padding, self._idx - (self.window - 1))

    def extract(self, idx: int) -> WindowKVCache:
        """Sequence ``idx``'s visible rows as a solo ``WindowKVCache`` (for tests and checks)."""
        solo, rows = WindowKVCache(self.window), super().extract(idx)
        solo.keys, solo.values = rows.keys, rows.values
        solo.offset = int(self.offset[idx].item())
        solo.start = solo.offset - rows.offset
        return solo
