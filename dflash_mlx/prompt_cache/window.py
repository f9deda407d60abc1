"""The KV cache of a sliding-window attention layer of a target, with exact rollback.

mlx-lm gives those layers a ``RotatingKVCache`` of the window's size. Once it has wrapped
around it can no longer be trimmed (``is_trimmable()`` turns False and
``trim_prompt_cache`` then trims nothing), so rejected drafts would stay in it. mlx-lm has
no trimmable windowed cache, hence this one: it keeps, besides the window, the ``slack``
most recent rows a rollback may remove, and drops older rows in chunks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache


class WindowKVCache(_BaseCache):
    """KV cache of a sliding-window attention layer with exact rollback.

    A query at absolute position p attends keys at positions k with
    ``p - window < k <= p`` (mlx-lm's sliding-window mask). The cache holds the rows
    of positions ``[start, offset)``; after every update it still holds the
    ``window - 1 + slack`` rows before ``offset`` (older ones are dropped, ``step``
    rows at a time), so removing up to ``slack`` rows of the last update leaves every
    row the next query can see.

    Args:
        window: W, the layer's sliding window in tokens.
        slack: most rows one rollback removes (the largest verify, in tokens).

    Attributes:
        keys, values: [1, n_kv_heads, capacity, head_dim]; rows ``0..offset-start``
            are positions ``start..offset-1``.
        offset: absolute position after the last row (tokens seen).
        start: absolute position of the first row held.
    """

    step = 256

    def __init__(self, window: int, slack: int = 0):
        self.window, self.slack = int(window), int(slack)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self.start = 0

    @property
    def held(self) -> int:
        """Rows held (tokens ``start..offset-1``)."""
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append [1, H, S, D] keys and values; return every held row, oldest first."""
        n, held = keys.shape[2], self.held
        if self.keys is None or held + n > self.keys.shape[2]:
            self.keys, self.values = self._copy(0, held, held + n, keys, values)
        self.keys[..., held : held + n, :] = keys
        self.values[..., held : held + n, :] = values
        self.offset += n
        out = self.keys[..., : held + n, :], self.values[..., : held + n, :]
        excess = self.held - (self.window - 1 + self.slack)
        if excess >= self.step:
            kept = self._copy(excess, self.held - excess, self.held - excess, keys, values)
            # One statement: an interrupt cannot leave start and the rows out of step.
            self.start, (self.keys, self.values) = self.start + excess, kept
        return out

    def _copy(self, first: int, count: int, need: int, keys: mx.array, values: mx.array):
        """New buffers of capacity >= ``need`` rows (a multiple of ``step``) holding
        rows ``first..first+count`` of the current ones; shape and dtype as
        ``keys``/``values``. Returns ``(keys, values)``."""
        cap = -(-max(need, 1) // self.step) * self.step
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None and count > 0:
            new_k[..., :count, :] = self.keys[..., first : first + count, :]
            new_v[..., :count, :] = self.values[..., first : first + count, :]
        return new_k, new_v

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        """Mask of N new queries over the held rows plus the N new ones: causal and
        windowed in absolute positions (``"causal"`` or None where the window cuts
        nothing, as mlx-lm's caches return them)."""
        window = window_size or self.window
        if self.held + N <= window:  # no key is outside any query's window
            return None if N == 1 else "causal"
        return create_causal_mask(N, self.held, window_size=window)

    def can_trim(self, n: int) -> bool:
        """Whether removing the last ``n`` rows leaves every row the next query sees."""
        new = self.offset - n
        return 0 <= n and new >= 0 and (self.start == 0 or new - self.start >= self.window - 1)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove the last ``n`` rows; returns ``n``, or 0 (nothing removed) when
        rows the next query needs were already dropped (see :meth:`can_trim`)."""
        if not self.can_trim(n):
            return 0
        self.offset -= n
        return n

    def size(self) -> int:
        return self.held

    def rows(self) -> Tuple[mx.array, mx.array]:
        """The held keys and values, [1, H, held, D] each."""
        return self.keys[..., : self.held, :], self.values[..., : self.held, :]

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.start, self.window, self.slack

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.start, self.window, self.slack = v

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
