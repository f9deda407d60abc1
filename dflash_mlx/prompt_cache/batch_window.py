"""The sliding-window layer cache of a batch: mlx-lm's ``BatchKVCache`` (left-padded rows ending at one
write column, per-sequence offsets and ragged rollback) with the window applied by the mask; rows no
query can see any more count as padding, which :func:`~dflash_mlx.prompt_cache.batch.compact` drops."""

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
        """One sequence's prefilled window cache as a batch of one (its held rows, no padding)."""
        batch = cls(solo.window, [0])
        if solo.keys is not None:
            keys, values = solo.rows()
            batch.keys, batch.values = mx.contiguous(keys), mx.contiguous(values)
            batch._idx = solo.held
        batch.offset = mx.array([solo.offset])
        return batch

    def make_mask(self, N: int, window_size: Optional[int] = None, **kwargs) -> mx.array:
        """[B, 1, N, _idx + N] bool: causal, windowed (this layer's window unless given), padding hidden."""
        return super().make_mask(N, window_size=window_size or self.window, **kwargs)

    def hide_old_rows(self) -> None:
        """Count as padding the columns before ``_idx - (W - 1)`` (between steps no query sees them)."""
        if self.keys is not None:
            self.left_padding = mx.maximum(self.left_padding, self._idx - (self.window - 1))

    def extract(self, idx: int) -> WindowKVCache:
        """Sequence ``idx``'s visible rows as a solo ``WindowKVCache``."""
        solo, rows = WindowKVCache(self.window), super().extract(idx)
        solo.keys, solo.values = rows.keys, rows.values
        solo.offset = int(self.offset[idx].item())
        solo.start = solo.offset - rows.offset
        return solo
