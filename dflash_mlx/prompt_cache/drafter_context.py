"""The drafter's context cache: sink rows plus a window of recent rows at absolute positions, exact rollback."""

from typing import Tuple

import mlx.core as mx

from .window import RowCache


class ContextWindowCache(RowCache):
    """The drafter's context K/V: the first ``sink`` (>= 0) rows plus the last ``window`` (>= 1; checked by
    :meth:`~dflash_mlx.drafter.network.DFlashDrafter.set_draft_window`), and ``slack`` older rows so a rollback
    of ``slack`` rows is exact (spec section 9; ``--draft-window SINK,WINDOW``). ``offset``: rows seen;
    ``held``: rows stored, sink rows first."""

    fields = ("offset", "held", "sink", "window", "slack")

    def __init__(self, sink: int, window: int, slack: int = 0):
        self.sink, self.window, self.slack = int(sink), int(window), int(slack)
        self.offset = self.held = 0

    @property
    def n_sink(self) -> int:
        """Sink rows stored (positions ``0..n_sink-1``)."""
        return min(self.sink, self.offset)

    @property
    def recent(self) -> int:
        """Recent rows stored (positions ``offset-recent..offset-1``)."""
        return self.held - self.n_sink

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append [1, H, S, D] rows; return the visible ones (sink rows, then the last ``window``)."""
        self.held += self._append(keys, values, self.held)
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

    def _drop(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Forget the ``n`` oldest recent rows (never sink rows)."""
        s = self.n_sink
        rest_k = self.keys[..., s + n : self.held, :]
        rest_v = self.values[..., s + n : self.held, :]
        sink_k, sink_v = self.keys[..., :s, :], self.values[..., :s, :]
        held = self.held - n
        self.keys, self.values = self._buffers(0, 0, held + self.step, keys, values)
        self.keys[..., :s, :], self.values[..., :s, :] = sink_k, sink_v
        self.keys[..., s:held, :], self.values[..., s:held, :] = rest_k, rest_v
        self.held = held

    def invisible(self, n: int) -> Tuple[int, int]:
        """Rows ``[lo, hi)`` of the next ``n`` that no query will see (for :meth:`skip`)."""
        lo = max(self.offset, self.sink) - self.offset
        hi = n - self.window
        return (lo, hi) if hi > lo else (0, 0)

    def skip(self, n: int) -> None:
        """Advance ``offset`` by ``n`` unstored rows, dropping the recent rows held.

        Raises:
            ValueError: sink rows are still to come."""
        if self.offset < self.sink:
            raise ValueError("ContextWindowCache.skip: sink rows cannot be skipped")
        self.held = self.n_sink
        self.offset += n

    def can_trim(self, n: int) -> bool:
        """Whether removing the last ``n`` rows leaves every row the next query sees."""
        new = self.offset - n
        return min(n, new) >= 0 and (new <= self.sink or max(self.sink, new - self.window) >= self.offset - self.recent)

    def _remove(self, n: int) -> None:
        new = self.offset - n
        self.held = new if new <= self.sink else self.held - n
        self.offset = new
