"""The target cache of a batch of sequences (``dflash serve --max-batch``), per layer a left-padded
``BatchKVCache``, ``BatchWindowKVCache`` or ``BatchGatedDeltaCache``, rolled back exactly per sequence
(:func:`~dflash_mlx.prompt_cache.rollback.rollback`)."""

from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update

from .gated_delta import GatedDeltaCache
from .window import WindowKVCache

BATCHABLE = (KVCache, GatedDeltaCache, WindowKVCache)  # layer cache types with a batched form


class BatchWindowKVCache(BatchKVCache):
    """A ``BatchKVCache`` of a sliding-window layer (window W applied by the mask); rows no query sees
    count as padding (:meth:`hide_old_rows`). ``left_padding``: [N]; ``offset``: [N] absolute positions."""

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


class BatchGatedDeltaCache(GatedDeltaCache):
    """A :class:`GatedDeltaCache` of N sequences (first axis), built from one prefilled ``solo`` cache;
    rolled back per sequence by a masked replay (spec section 10)."""

    def __init__(self, solo: GatedDeltaCache):
        super().__init__(solo.owner, solo.slack)
        self.cache = list(solo.cache)
        self.offset = solo.offset  # tokens fed to the batch's forwards; not a position

    def extend(self, other: "BatchGatedDeltaCache") -> None:
        """Append ``other``'s sequences (between steps)."""
        super().extend(other)
        self._last = None

    def filter(self, batch_indices: mx.array) -> None:
        """Keep only the sequences at ``batch_indices`` (between steps)."""
        super().filter(batch_indices)
        self._last = None

    def trim_ragged(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[i]`` tokens of the last forward from sequence i (each one :meth:`can_trim`
        allows: :func:`~dflash_mlx.prompt_cache.rollback.rollback` checks them)."""
        if not any(rejected):
            return
        f = self._last
        keep = mx.array([f.rows - r for r in rejected], dtype=mx.int32)
        steps = mx.arange(f.rows)[None] < keep[:, None]  # [N, L]
        _, state = gated_delta_update(f.q, f.k, f.v, f.a, f.b, f.A_log, f.dt_bias, f.before[1], steps,
                                      use_kernel=f.use_kernel)
        width = f.conv_input.shape[1] - f.rows  # K - 1
        rows = (keep[:, None] + mx.arange(width)[None])[..., None]  # [N, K-1, 1]
        conv = mx.take_along_axis(f.conv_input, rows, axis=1)
        self.cache = [conv, state]
        self._last = None


def not_batchable(target: Any) -> Optional[str]:
    """Why ``target`` cannot decode in a batch exactly (names the layer cache), or None."""
    for i, c in enumerate(target.make_cache(1)):
        if type(c) not in BATCHABLE:
            return f"target layer {i} keeps a {type(c).__name__}, which has no batched form with per-sequence rollback"
    return None


def extend(batch: Optional[List[BatchKVCache]], cache: Sequence[KVCache]) -> List[BatchKVCache]:
    """Append one sequence's prefilled cache to ``batch`` (in place; a new batch when None); returns it, evaluated."""
    joined = [BatchGatedDeltaCache(c) if isinstance(c, GatedDeltaCache) else BatchWindowKVCache.from_solo(c)
              if isinstance(c, WindowKVCache) else BatchKVCache.merge([c]) for c in cache]  # each a batch of one
    for b, c in zip(batch or [], joined):
        b.extend(c)
    batch = batch or joined
    mx.eval([b.state for b in batch])  # the copies are made where a sequence joins, not in the next step
    return batch


def keep_rows(batch: List[BatchKVCache], rows: Sequence[int]) -> Optional[List[BatchKVCache]]:
    """Keep only the sequences at ``rows`` (in that order; evaluated); None when none is left."""
    if not rows:
        return None
    index = mx.array(list(rows), dtype=mx.int32)
    for b in batch:
        b.filter(index)
    mx.eval([b.state for b in batch])  # where sequences leave, not in the next step
    return batch


def common_padding(b: BatchKVCache, right: Sequence[int]) -> int:
    """Columns of left padding every sequence of ``b`` has once its last ``right[i]`` rows are padding."""
    return min(p + r for p, r in zip(b.left_padding.tolist(), right))


class RaggedRoll:
    """Roll sequence i's rows right by ``right[i]`` columns into its left padding and drop the first ``drop``
    columns (``drop <= common_padding(b, right)``): each sequence's rows rolled on their own (``mx.roll``, one
    copy of the buffer, no gather)."""

    def __init__(self, right: Sequence[int], drop: int = 0):
        self.right, self.drop, self._shifts = mx.array(list(right)), drop, [r - drop for r in right]

    def __call__(self, b: BatchKVCache) -> None:
        b.keys, b.values = (mx.concatenate([mx.roll(a[i : i + 1], s, axis=2) if s else a[i : i + 1]
                                            for i, s in enumerate(self._shifts)]) for a in (b.keys, b.values))
        b.offset = b.offset - self.right
        b.left_padding = b.left_padding + mx.array(self._shifts)
        b._idx -= self.drop


def share_offsets(batch: Sequence[Any]) -> None:
    """Make the full-attention layers' (equal) offsets one array object (the fused RoPE computes once); caches
    not batched (one sequence's own, int offsets) are left as they are."""
    full = [b for b in batch or () if type(b) is BatchKVCache]
    for b in full[1:]:
        b.offset = full[0].offset


COMPACT_AT = 32  # columns of padding every sequence has before they are dropped


def compact(batch: Optional[Sequence[Any]], at_least: int = COMPACT_AT) -> None:
    """Drop the padding columns every sequence has once there are ``at_least`` (window layers: old rows too);
    caches not batched (one sequence's own) are left as they are."""
    layers = [b for b in batch or () if isinstance(b, BatchKVCache) and b.keys is not None]
    for b in layers:
        if isinstance(b, BatchWindowKVCache):
            b.hide_old_rows()
    for group in ([b for b in layers if not isinstance(b, BatchWindowKVCache)],
                  [b for b in layers if isinstance(b, BatchWindowKVCache)]):
        if group and min(group[0].left_padding.tolist()) >= at_least:
            keep = mx.arange(len(group[0].left_padding))
            for b in group:
                b.filter(keep)
