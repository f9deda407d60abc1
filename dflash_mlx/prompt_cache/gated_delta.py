"""The cache of a Gated-DeltaNet layer (hybrid targets) with exact rollback (spec section 10)."""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update


@dataclass
class _Forward:
    """The last forward of L tokens as recorded: the state before it, the conv input [1, K-1+L, C] and
    the recurrence inputs ``q, k`` [1, L, Hk, Dk], ``v`` [1, L, Hv, Dv], ``a, b`` [1, L, Hv]."""

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
    """mlx-lm's ``ArraysCache`` of one Gated-DeltaNet layer (``[conv_state [1, K-1, C], recurrent_state
    [1, Hv, Dv, Dk] float32]``) that rolls back within its last forward of at most ``slack`` tokens by
    replaying the recorded inputs (spec section 10). ``owner``: the layer's ``linear_attn``; ``offset``: tokens seen.
    """

    def __init__(self, owner: Any = None, slack: int = 0):
        super().__init__(size=2)
        self.owner, self.slack = owner, int(slack)
        self.offset = 0
        self._last: Optional[_Forward] = None

    def store(self, conv_input: mx.array, state: mx.array, q: mx.array, k: mx.array, v: mx.array, a: mx.array,
              b: mx.array, A_log: mx.array, dt_bias: mx.array, mask: Optional[mx.array], use_kernel: bool) -> None:
        """Take the state after a forward of L tokens (as in :class:`_Forward`), recorded when L <= ``slack``."""
        L = q.shape[1]
        width = conv_input.shape[1] - L  # K - 1
        forward = None
        if L <= self.slack:
            forward = _Forward(self.offset, list(self.cache), conv_input, q, k, v, a, b, A_log, dt_bias,
                               mask, use_kernel)
        conv = mx.contiguous(conv_input[:, -width:, :])
        self.cache, self.offset, self._last = [conv, state], self.offset + L, forward

    def advance(self, N: int) -> None:
        """Count a forward run by mlx-lm's module (nothing recorded)."""
        super().advance(N)
        self.offset, self._last = self.offset + N, None

    def can_trim(self, n: int) -> bool:
        """Whether the last ``n`` tokens lie within the last forward, and it was recorded."""
        f = self._last
        return n == 0 or (f is not None and 0 < n and f.start <= self.offset - n <= self.offset <= f.start + f.rows)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n``, or 0 (nothing changed) where :meth:`can_trim` is False."""
        if n == 0 or not self.can_trim(n):
            return 0
        f = self._last
        keep = self.offset - n - f.start
        if keep > 0:
            width = f.conv_input.shape[1] - f.rows  # K - 1
            mask = None if f.mask is None else f.mask[:, :keep]
            _, state = gated_delta_update(f.q[:, :keep], f.k[:, :keep], f.v[:, :keep], f.a[:, :keep], f.b[:, :keep],
                                          f.A_log, f.dt_bias, f.before[1], mask, use_kernel=f.use_kernel)
            conv = mx.contiguous(f.conv_input[:, keep : keep + width])
            self.cache, self.offset = [conv, state], f.start + keep  # one statement (interrupts)
            return n
        self.cache, self.offset = list(f.before), f.start
        return n

    def size(self) -> int:
        return self.offset
