"""The Gated-DeltaNet layer cache of a batch of sequences, with per-sequence rollback.

A recurrent layer has no rows and no positions: its state per sequence is a conv
state [K-1, C] and a recurrent state [Hv, Dv, Dk], so a batch is those stacked along
the first axis, and sequences join (``extend``) and leave (``filter``) as mlx-lm's
``ArraysCache`` does. Every verify feeds each sequence the same number of tokens, all
real, so no padding mask is needed. After a verify, sequence i keeps its first
``keep[i]`` tokens: the recurrence is replayed from the state before the verify over
the recorded inputs with a mask that stops sequence i after ``keep[i]`` steps (a
masked step keeps the state, in mlx-lm's own ``gated_delta_update``), and each conv
state is rows ``keep[i] .. keep[i]+K-2`` of its conv input. Step by step the same
recurrence as the one-sequence :class:`GatedDeltaCache` replays, so the kept state is
the one the verify itself passed through.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

from .gated_delta import GatedDeltaCache


class BatchGatedDeltaCache(GatedDeltaCache):
    """A :class:`GatedDeltaCache` whose arrays hold N sequences (first axis).

    Args:
        solo: one sequence's prefilled cache (its conv and recurrent state are taken).
    """

    def __init__(self, solo: GatedDeltaCache):
        super().__init__(solo.owner, solo.slack)
        self.cache = list(solo.cache)
        self.offset = solo.offset  # tokens fed to the batch's forwards; not a position

    def extend(self, other: "BatchGatedDeltaCache") -> None:
        """Append ``other``'s sequences (between steps: the last forward is forgotten)."""
        super().extend(other)
        self._last = None

    def filter(self, batch_indices: mx.array) -> None:
        """Keep only the sequences at ``batch_indices`` (between steps)."""
        super().filter(batch_indices)
        self._last = None

    def trim_ragged(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[i]`` tokens of the last forward from sequence i.

        Raises:
            ValueError: the last forward was not recorded (a prefill chunk) or is
                shorter than a rejection.
        """
        if not any(rejected):
            return
        f = self._last
        if f is None or max(rejected) > f.rows:
            raise ValueError("Gated-DeltaNet batch cache: the last forward cannot be rolled back")
        keep = mx.array([f.rows - r for r in rejected], dtype=mx.int32)
        steps = mx.arange(f.rows)[None] < keep[:, None]  # [N, L]
        _, state = gated_delta_update(f.q, f.k, f.v, f.a, f.b, f.A_log, f.dt_bias, f.before[1], steps,
                                      use_kernel=f.use_kernel)
        width = f.conv_input.shape[1] - f.rows  # K - 1
        rows = (keep[:, None] + mx.arange(width)[None])[..., None]  # [N, K-1, 1]
        conv = mx.take_along_axis(f.conv_input, rows, axis=1)
        self.cache = [conv, state]
        self._last = None
