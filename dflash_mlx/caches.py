"""A sliding-window KV cache that rolls back exactly.

mlx-lm gives sliding-window layers a ``RotatingKVCache`` of the window's size. Once
it has wrapped around it can no longer be trimmed (``is_trimmable()`` turns False and
``trim_prompt_cache`` then trims nothing), so rejected drafts would stay in it. mlx-lm
has no trimmable windowed cache, hence this one: it keeps, besides the window, the
``slack`` most recent rows a rollback may remove, and drops older rows in chunks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache


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




class ContextWindowCache(_BaseCache):
    """The drafter's context K/V, bounded: the first ``sink`` rows plus the last ``window``.

    Used for the drafter's sliding-window layers (``sink`` 0, ``window`` W-1: a block
    query at the cache's offset sees exactly the W-1 context rows before it, spec
    section 9) and for ``--draft-window SINK,WINDOW`` on full-attention layers, so
    drafting cost stops growing with the context. Keys are stored with RoPE already
    applied at their absolute positions, and ``offset`` counts every row ever seen, so
    positions stay absolute when rows are dropped.

    Besides the window it keeps up to ``slack`` older rows, so a rollback of up to
    ``slack`` rows stays exact, and drops rows ``step`` at a time (amortized copies).

    Args:
        sink: rows at positions ``0..sink-1`` kept for good (attention sinks).
        window: most recent rows kept (>= 1).
        slack: extra recent rows kept for rollback.

    Attributes:
        offset: absolute position after the last row (rows seen).
        held: rows stored (sink rows first, then recent rows oldest first).
    """

    step = 256

    def __init__(self, sink: int, window: int, slack: int = 0):
        if sink < 0 or window < 1 or slack < 0:
            raise ValueError(f"ContextWindowCache needs sink >= 0, window >= 1, slack >= 0; got {sink}, {window}, {slack}")
        self.sink, self.window, self.slack = int(sink), int(window), int(slack)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self.held = 0

    @property
    def n_sink(self) -> int:
        """Sink rows stored (positions ``0..n_sink-1``)."""
        return min(self.sink, self.offset)

    @property
    def recent(self) -> int:
        """Recent rows stored (positions ``offset-recent..offset-1``)."""
        return self.held - self.n_sink

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append [1, H, S, D] rows; return the visible ones, [1, H, n_sink + min(recent, window), D]:
        the sink rows, then the last ``window`` rows, oldest first."""
        n = keys.shape[2]
        if self.keys is None or self.held + n > self.keys.shape[2]:
            self._resize(self.held, self.held + n, keys, values)
        self.keys[..., self.held : self.held + n, :] = keys
        self.values[..., self.held : self.held + n, :] = values
        self.held += n
        self.offset += n
        visible = self.fetch()
        if self.recent >= self.window + self.slack + self.step:
            self._drop(self.recent - self.window - self.slack, keys, values)
        return visible

    def fetch(self) -> Tuple[mx.array, mx.array]:
        """The visible rows (see :meth:`update_and_fetch`) without adding any."""
        s, first = self.n_sink, self.held - min(self.recent, self.window)
        k, v = self.keys, self.values
        if first == s or s == 0:  # one contiguous run of rows: a view, no copy
            lo = 0 if first == s else first
            return k[..., lo : self.held, :], v[..., lo : self.held, :]
        return (mx.concatenate([k[..., :s, :], k[..., first : self.held, :]], axis=2),
                mx.concatenate([v[..., :s, :], v[..., first : self.held, :]], axis=2))

    def _resize(self, keep: int, need: int, keys: mx.array, values: mx.array) -> None:
        cap = -(-max(need, 1) // self.step) * self.step
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None and keep > 0:
            new_k[..., :keep, :] = self.keys[..., :keep, :]
            new_v[..., :keep, :] = self.values[..., :keep, :]
        self.keys, self.values = new_k, new_v

    def _drop(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Forget the ``n`` oldest recent rows (never sink rows)."""
        s = self.n_sink
        rest_k = self.keys[..., s + n : self.held, :]
        rest_v = self.values[..., s + n : self.held, :]
        sink_k, sink_v = self.keys[..., :s, :], self.values[..., :s, :]
        held = self.held - n
        self._resize(0, held + self.step, keys, values)
        self.keys[..., :s, :], self.values[..., :s, :] = sink_k, sink_v
        self.keys[..., s:held, :], self.values[..., s:held, :] = rest_k, rest_v
        self.held = held

    def invisible(self, n: int) -> Tuple[int, int]:
        """Rows ``[lo, hi)`` of the next ``n`` that no query will see once all ``n`` are in.

        They are neither sink rows nor among the last ``window``; the drafter skips
        computing them (:meth:`skip`), which bounds a long prefill's cost too.
        """
        lo = max(self.offset, self.sink) - self.offset
        hi = n - self.window
        return (lo, hi) if hi > lo else (0, 0)

    def skip(self, n: int) -> None:
        """Advance ``offset`` by ``n`` rows that are not stored (see :meth:`invisible`).
        The recent rows held fall out of the window with them and are dropped."""
        if self.offset < self.sink:
            raise ValueError("ContextWindowCache.skip: sink rows cannot be skipped")
        self.held = self.n_sink
        self.offset += n

    def can_trim(self, n: int) -> bool:
        """Whether removing the last ``n`` rows leaves every row the next query sees."""
        new = self.offset - n
        if n < 0 or new < 0:
            return False
        return new <= self.sink or max(self.sink, new - self.window) >= self.offset - self.recent

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove the last ``n`` rows; returns ``n``, or 0 (nothing removed) when
        rows the next query needs were already dropped (see :meth:`can_trim`)."""
        if not self.can_trim(n):
            return 0
        new = self.offset - n
        self.held = new if new <= self.sink else self.held - n
        self.offset = new
        return n

    def size(self) -> int:
        return self.held

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.held, self.sink, self.window, self.slack

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.held, self.sink, self.window, self.slack = v

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, ContextWindowCache)  # trim() removes rows exactly


def can_trim(c: object, n: int) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly."""
    if isinstance(c, (WindowKVCache, ContextWindowCache)):
        return c.can_trim(n)
    return isinstance(c, EXACT_TRIM) and 0 <= n <= c.offset
