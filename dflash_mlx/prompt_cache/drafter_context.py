"""The drafter's context cache: a sink of first rows plus a window of recent rows
(sliding drafter layers, ``--draft-window``), at absolute offsets, with exact rollback.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


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
