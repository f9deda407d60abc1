"""What the decode loop needs of a drafter, and one base for drafters that wrap another.

:class:`dflash_mlx.drafter.DFlashDrafter` satisfies :class:`Drafter`; so do the
simulated-acceptance drafter of ``dflash bench`` and the scripted drafters of the
tests, which subclass :class:`WrappedDrafter` and replace only :meth:`draft`.
"""

from __future__ import annotations

from typing import Any, List, Protocol, Sequence, runtime_checkable

import mlx.core as mx


@runtime_checkable
class Drafter(Protocol):
    """A DFlash drafter as the loop uses it (DFLASH_SPEC.md sections 4-5).

    Attributes:
        block_size: trained block size B (tokens per verify, the anchor included).
        target_layer_ids: 0-based target layers whose outputs are the context
            features (``dflash_config.target_layer_ids``).
    """

    block_size: int
    target_layer_ids: List[int]

    def make_cache(self) -> List[Any]:
        """A fresh context cache (one entry per drafter layer)."""

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        """Drafts for one block.

        Args:
            token: [1] int32, the last committed token ``t_last``.
            context: [1, S, K*H] context features of the S new committed rows,
                at positions ``[offset, offset + S)`` of the drafter cache; ``t_last``
                sits at ``offset + S``.
            cache: the drafter's context cache, extended in place by the S rows.
            block_size: B, 2 <= B <= ``self.block_size``.

        Returns:
            [B-1] int32 drafts d_1..d_{B-1} (may be lazy).
        """

    def ingest(self, context: mx.array, cache: Sequence[Any]) -> None:
        """Append context rows to the cache without drafting (same layout as ``draft``)."""


class WrappedDrafter:
    """A drafter that delegates everything to ``inner``; subclasses override :meth:`draft`.

    Args:
        inner: the wrapped :class:`Drafter`.
    """

    def __init__(self, inner: Drafter):
        self.inner = inner

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def target_layer_ids(self) -> List[int]:
        return self.inner.target_layer_ids

    def make_cache(self) -> List[Any]:
        return self.inner.make_cache()

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        return self.inner.draft(token, context, cache, block_size)

    def ingest(self, context: mx.array, cache: Sequence[Any]) -> None:
        self.inner.ingest(context, cache)
