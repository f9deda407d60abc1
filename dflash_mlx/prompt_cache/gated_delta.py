"""The cache of a Gated-DeltaNet layer (hybrid targets), with exact rollback.

mlx-lm keeps such a layer's state in an ``ArraysCache`` (conv state, recurrent state)
that has no rows to drop at all; :class:`GatedDeltaCache` keeps what it needs to replay
the accepted prefix of the last forward (DFLASH_SPEC.md section 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update


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
        owner: the layer's ``linear_attn`` module;
            :meth:`~dflash_mlx.targets.hybrid.HybridAdapter.check_layer_cache` refuses a
            cache whose owner is another model's layer.
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
