# Over 400 lines: the three caches that roll back exactly (target windows, Gated-DeltaNet, the drafter's context) and their one trim contract
"""Layer caches that roll back exactly, for layers whose mlx-lm cache cannot.

- :class:`WindowKVCache`, for sliding-window attention. mlx-lm gives those layers a
  ``RotatingKVCache`` of the window's size. Once it has wrapped around it can no
  longer be trimmed (``is_trimmable()`` turns False and ``trim_prompt_cache`` then
  trims nothing), so rejected drafts would stay in it. mlx-lm has no trimmable
  windowed cache, hence this one: it keeps, besides the window, the ``slack`` most
  recent rows a rollback may remove, and drops older rows in chunks.
- :class:`GatedDeltaCache`, for Gated-DeltaNet layers (hybrid targets). mlx-lm keeps
  their state in an ``ArraysCache`` (conv state, recurrent state) that has no rows
  to drop at all; this one keeps what it needs to replay the accepted prefix of the
  last forward (DFLASH_SPEC.md section 10).
- :class:`ContextWindowCache`, for the drafter's context: a sink of first rows plus a
  window of recent rows (sliding drafter layers, ``--draft-window``), absolute offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, _BaseCache
from mlx_lm.models.gated_delta import gated_delta_update


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


@dataclass
class _Forward:
    """What :class:`GatedDeltaCache` keeps of the last forward (L tokens) to replay
    a prefix of it: the state before it, the conv input ``[1, K-1+L, C]`` and the
    recurrence inputs ``q, k [1, L, Hk, Dk]``, ``v [1, L, Hv, Dv]``, ``a, b [1, L, Hv]``
    exactly as the forward computed them."""

    start: int
    before: List[Optional[mx.array]]
    conv_input: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    A_log: mx.array
    dt_bias: mx.array
    mask: Optional[mx.array]
    use_kernel: bool

    @property
    def rows(self) -> int:
        return self.q.shape[1]


class GatedDeltaCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` of one Gated-DeltaNet layer, with exact rollback.

    The state ``[conv_state [1, K-1, C], recurrent_state [1, Hv, Dv, Dk] float32]`` has
    no rows to drop, so a rollback rebuilds the state of a run that only saw the
    first ``keep`` tokens of the last forward (DFLASH_SPEC.md section 10): the conv
    state is rows ``keep .. keep+K-2`` of that forward's conv input, and the
    recurrent state is mlx-lm's own ``gated_delta_update`` replayed over the first
    ``keep`` steps of the recorded recurrence inputs, from the state before the
    forward. The recurrence runs step by step, so the replayed state is bit for bit
    the state the forward itself passed through after ``keep`` steps.

    Why this design. Exactness first: the replayed state is bit for bit the one the
    verify itself reached after ``keep`` steps, so it agrees with the logits that
    accepted those tokens; re-running the layer's own module on the kept rows would
    recompute the projections with another row count (other matmul kernels, last-bit
    differences). Then cost (docs/benchmarks.md, Qwen3.5-0.8B shape, CPU): the replay
    costs 1.4-18% of a verify depending on ``keep``, re-running the module 2-7x
    more, since it re-reads the input projections' weights. Keeping per-step states
    would cost ``L * Hv * Dv * Dk`` floats per layer and forward, and mlx-lm's
    ``gated_delta_update`` returns only the last one.

    The forward that records (see :meth:`store`) is the adapter's, which computes
    the layer exactly as mlx-lm's module does. A forward of more than ``slack``
    tokens (a prefill chunk) keeps nothing, to bound memory; so does one run by the
    mlx-lm module itself (through ``cache[i] = ...`` and :meth:`advance`). Such a
    forward cannot be rolled back into.

    Args:
        owner: the layer's ``linear_attn`` module; :meth:`TargetAdapter.check_cache`
            refuses a cache whose owner is another model's layer.
        slack: most tokens of a forward that can be rolled back (the largest verify).

    Attributes:
        offset: tokens seen.
    """

    def __init__(self, owner: Any = None, slack: int = 0):
        super().__init__(size=2)
        self.owner, self.slack = owner, int(slack)
        self.offset = 0
        self._last: Optional[_Forward] = None

    def store(self, conv_input: mx.array, state: mx.array, q: mx.array, k: mx.array, v: mx.array,
              a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array, mask: Optional[mx.array],
              use_kernel: bool) -> None:
        """Take the new state of one forward of L tokens and keep what a rollback
        replays (shapes as in :class:`_Forward`; ``state`` [1, Hv, Dv, Dk]).

        The conv state becomes the last K-1 rows of ``conv_input``, as mlx-lm keeps
        it. State, offset and record change in one statement, so an interrupt leaves
        either the whole forward or none of it.
        """
        L = q.shape[1]
        width = conv_input.shape[1] - L  # K - 1
        forward = None
        if L <= self.slack:
            forward = _Forward(self.offset, list(self.cache), conv_input, q, k, v, a, b, A_log, dt_bias,
                               mask, use_kernel)
        conv = mx.contiguous(conv_input[:, -width:, :])
        self.cache, self.offset, self._last = [conv, state], self.offset + L, forward

    def advance(self, N: int) -> None:
        """A forward run by mlx-lm's module: counted, but it keeps nothing to replay."""
        super().advance(N)
        self.offset, self._last = self.offset + N, None

    def can_trim(self, n: int) -> bool:
        """Whether the last ``n`` tokens can be removed exactly: they lie within the
        last forward, and that forward was recorded."""
        if n == 0:
            return True
        f = self._last
        return f is not None and 0 < n and f.start <= self.offset - n <= self.offset <= f.start + f.rows

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n``, or 0 (nothing changed) when
        :meth:`can_trim` says no. Can be called again for fewer tokens of the same
        forward (the loop trims rejected drafts, then a block cut at a stop token)."""
        if n == 0 or not self.can_trim(n):
            return 0
        f = self._last
        keep = self.offset - n - f.start
        if keep > 0:
            width = f.conv_input.shape[1] - f.rows  # K - 1
            mask = None if f.mask is None else f.mask[:, :keep]
            _, state = gated_delta_update(
                f.q[:, :keep], f.k[:, :keep], f.v[:, :keep], f.a[:, :keep], f.b[:, :keep],
                f.A_log, f.dt_bias, f.before[1], mask, use_kernel=f.use_kernel,
            )
            conv = mx.contiguous(f.conv_input[:, keep : keep + width])
            self.cache, self.offset = [conv, state], f.start + keep  # one statement (interrupts)
            return n
        self.cache, self.offset = list(f.before), f.start
        return n

    def size(self) -> int:
        return self.offset


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


EXACT_TRIM = (KVCache, QuantizedKVCache, WindowKVCache, GatedDeltaCache, ContextWindowCache)  # trim() is exact or refuses


def can_trim(c: object, n: int) -> bool:
    """Whether one layer's cache can remove its last ``n`` rows exactly."""
    if isinstance(c, (WindowKVCache, GatedDeltaCache, ContextWindowCache)):
        return c.can_trim(n)
    return isinstance(c, EXACT_TRIM) and 0 <= n <= c.offset
