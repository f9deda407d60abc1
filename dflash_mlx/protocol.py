"""What the decode loop needs of a drafter, and one base for drafters that wrap another.

:class:`dflash_mlx.drafter.network.DFlashDrafter` satisfies :class:`Drafter`; so do the
simulated-acceptance drafter of ``dflash bench`` and the scripted drafters of the
tests, which subclass :class:`WrappedDrafter` and replace only :meth:`draft`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx


@dataclass
class Proposal:
    """The drafts of one block and the distribution q they were drawn from.

    What the acceptance rules read (DFLASH_SPEC.md sections 5 and 9), and what a
    tree verifier (DDTree, spec section 7) reads: per-position log-probs of one pass.

    Attributes:
        tokens: [B-1] int32 drafts d_1..d_{B-1}.
        q_ids: [B-1, k] int32 candidate ids of each position, or None.
        q_probs: [B-1, k] float32 q_i over those candidates (rows sum to 1), or None:
            the drafts are deterministic (q is one-hot on ``tokens``).
        logprobs: [B-1, V] the drafter's log-probabilities per position, or None;
            lazy, computed only if read.
    """

    tokens: mx.array
    q_ids: Optional[mx.array] = None
    q_probs: Optional[mx.array] = None
    logprobs: Optional[mx.array] = None

    def head(self, k: int) -> "Proposal":
        """The first ``k`` drafts (a verify narrower than the drafted block)."""
        if k == self.tokens.size:
            return self
        cut = lambda a: None if a is None else a[:k]  # noqa: E731
        return Proposal(self.tokens[:k], cut(self.q_ids), cut(self.q_probs), cut(self.logprobs))

    def arrays(self) -> List[mx.array]:
        """What a step evaluates: the drafts and q (never the lazy ``logprobs``)."""
        return [a for a in (self.tokens, self.q_ids, self.q_probs) if a is not None]


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

    # Optional (see :func:`propose`):
    #   propose(token, context, cache, block_size, sampling) -> Proposal
    #   samples_drafts: bool, True when drafts at T > 0 are samples of Proposal.q_probs
    #   drafter_format: str, the checkpoint format (``architectures[0]``)


def propose(drafter: "Drafter", token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int,
            sampling=None) -> Proposal:
    """``drafter.propose(...)`` when the drafter has it, else its greedy ``draft`` as a
    deterministic :class:`Proposal` (scripted and wrapped drafters need only ``draft``)."""
    if hasattr(drafter, "propose"):
        return drafter.propose(token, context, cache, block_size, sampling)
    return Proposal(drafter.draft(token, context, cache, block_size))


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

    @property
    def drafter_format(self) -> Optional[str]:
        return getattr(self.inner, "drafter_format", None)

    def make_cache(self) -> List[Any]:
        return self.inner.make_cache()

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        return self.inner.draft(token, context, cache, block_size)

    def ingest(self, context: mx.array, cache: Sequence[Any]) -> None:
        self.inner.ingest(context, cache)
