"""Layer caches of rows at absolute positions that drop old rows and still roll back exactly."""

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache


class RowCache(_BaseCache):
    """Keys and values [1, H, capacity, D] grown ``step`` rows at a time, trimmed only where :meth:`can_trim`;
    subclasses name their integers in ``fields``."""

    step = 256
    fields: Tuple[str, ...] = ()
    keys: Optional[mx.array] = None
    values: Optional[mx.array] = None

    def _buffers(self, first: int, count: int, need: int, keys: mx.array, values: mx.array):
        """New buffers of at least ``need`` rows (like ``keys``, ``values``) holding rows ``first..first+count``."""
        cap = -(-max(need, 1) // self.step) * self.step
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None and count > 0:
            new_k[..., :count, :] = self.keys[..., first : first + count, :]
            new_v[..., :count, :] = self.values[..., first : first + count, :]
        return new_k, new_v

    def _append(self, keys: mx.array, values: mx.array, held: int) -> int:
        """Write [1, H, S, D] rows after the ``held`` rows (growing the buffers); returns S."""
        n = keys.shape[2]
        if self.keys is None or held + n > self.keys.shape[2]:
            self.keys, self.values = self._buffers(0, held, held + n, keys, values)
        self.keys[..., held : held + n, :] = keys
        self.values[..., held : held + n, :] = values
        self.offset += n
        return n

    def trim(self, n: int) -> int:
        """Remove the last ``n`` rows; returns ``n``, or 0 (nothing removed) where :meth:`can_trim` is False."""
        if not self.can_trim(n):
            return 0
        self._remove(n)
        return n

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.held

    def rows(self) -> Tuple[mx.array, mx.array]:
        """The held keys and values, [1, H, held, D] each."""
        return self.keys[..., : self.held, :], self.values[..., : self.held, :]

    @property
    def state(self):
        return (self.keys, self.values, *(getattr(self, f) for f in self.fields))

    @state.setter
    def state(self, v):
        self.keys, self.values = v[0], v[1]
        for name, value in zip(self.fields, v[2:]):
            setattr(self, name, value)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class WindowKVCache(RowCache):
    """KV cache of a sliding-window layer (window W) holding positions ``[start, offset)``: at least the
    ``window - 1 + slack`` rows before ``offset``, so a rollback of ``slack`` rows is exact."""

    fields = ("offset", "start", "window", "slack")

    def __init__(self, window: int, slack: int = 0):
        self.window, self.slack = int(window), int(slack)
        self.offset = self.start = 0

    @property
    def held(self) -> int:
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append [1, H, S, D] keys and values; return every held row, oldest first."""
        self._append(keys, values, self.held)
        out = self.rows()
        excess = self.held - (self.window - 1 + self.slack)
        if excess >= self.step:
            kept = self._buffers(excess, self.held - excess, self.held - excess, keys, values)
            self.start, (self.keys, self.values) = self.start + excess, kept  # one statement (interrupts)
        return out

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        """Causal, windowed mask of N new queries; ``"causal"`` or None where the window cuts nothing."""
        window = window_size or self.window
        if self.held + N <= window:
            return None if N == 1 else "causal"
        return create_causal_mask(N, self.held, window_size=window)

    def can_trim(self, n: int) -> bool:
        """Whether removing the last ``n`` rows leaves every row the next query sees."""
        new = self.offset - n
        return 0 <= n and new >= 0 and (self.start == 0 or new - self.start >= self.window - 1)

    def _remove(self, n: int) -> None:
        self.offset -= n
