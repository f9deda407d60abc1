"""What the decode loop needs of a drafter (:class:`Drafter`), and a base for drafters that wrap another."""

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx

MAX_COPY = 15  # drafts a copy from the context proposes at most (prompt lookup): a verify of 16, as B=16


@dataclass
class Proposal:
    """The drafts of one block and the distribution q they were drawn from (spec sections 5, 7, 9 and 11).

    Attributes:
        tokens: [B-1] int32 drafts d_1..d_{B-1}.
        q_probs: [B-1, V] float32 q of each position (rows sum to 1), or None: q is one-hot on ``tokens``.
        logprobs: [B-1, V] the drafter's log-probabilities (lazy), or None.
    """

    tokens: mx.array
    q_probs: Optional[mx.array] = None
    logprobs: Optional[mx.array] = None

    def head(self, k: int) -> "Proposal":
        """The first ``k`` drafts."""
        if k == self.tokens.size:
            return self
        cut = lambda a: None if a is None else a[:k]  # noqa: E731
        return Proposal(self.tokens[:k], cut(self.q_probs), cut(self.logprobs))


@runtime_checkable
class Drafter(Protocol):
    """A DFlash drafter as the loop uses it (spec sections 4-5). Optional: ``propose`` (see
    :func:`propose`), ``samples_drafts`` (drafts at T > 0 are samples of q), ``drafter_format``,
    ``attention_path()`` (see :func:`attention_of`).

    Attributes:
        block_size: trained block size B (tokens per verify, the anchor included).
        target_layer_ids: 0-based target layers whose outputs are the context features.
    """

    block_size: int
    target_layer_ids: List[int]

    def make_cache(self) -> List[Any]:
        """A fresh context cache, one entry per drafter layer."""

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        """[B-1] int32 drafts (maybe lazy) after ``token`` [1] int32, the last committed token, whose
        position follows the S rows of ``context`` [1, S, K*H] appended to ``cache``; 2 <= B <= block_size."""

    def ingest(self, context: mx.array, cache: Sequence[Any]) -> None:
        """Append context rows to the cache without drafting."""


def propose(drafter: "Drafter", token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int,
            sampling=None, key: Optional[mx.array] = None) -> Proposal:
    """``drafter.propose(...)`` where it exists (``key``: the sequence's own for sampled drafts), else its
    ``draft`` as a deterministic :class:`Proposal`."""
    if hasattr(drafter, "propose"):
        return drafter.propose(token, context, cache, block_size, sampling, key)
    return Proposal(drafter.draft(token, context, cache, block_size))


def attention_of(drafter: Optional["Drafter"]) -> Optional[dict]:
    """``drafter.attention_path()``: what its latest draft ran; None for no drafter or one that does not say."""
    return drafter.attention_path() if hasattr(drafter, "attention_path") else None


class WrappedDrafter:
    """A drafter that delegates everything to ``inner``; subclasses override :meth:`draft`."""

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

    def attention_path(self) -> Optional[dict]:
        return attention_of(self.inner)

    def make_cache(self) -> List[Any]:
        return self.inner.make_cache()

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        return self.inner.draft(token, context, cache, block_size)

    def ingest(self, context: mx.array, cache: Sequence[Any]) -> None:
        self.inner.ingest(context, cache)
