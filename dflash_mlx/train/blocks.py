"""Anchors, block attention masks and loss weights for drafter training (spec section 6).

Each anchor ``a`` gives the block ``[token[a], MASK x (B-1)]`` at positions
``a..a+B-1``; block row k (1..B-1) is trained to predict ``token[a+k]``. All blocks of
a sequence share one forward: a block sees the context features of positions
``< a`` and its own rows (both ways), never another block.
"""

from __future__ import annotations

import numpy as np


def valid_anchors(length: int, response_start: int, block_size: int) -> np.ndarray:
    """Positions that may anchor a block: inside the response, ``1 <= a <= length - B``.

    The first anchor is the first response token, as at inference, where the first
    block is drafted from the token sampled after prefill.
    """
    lo = max(response_start, 1)
    hi = length - block_size
    return np.arange(lo, hi + 1) if hi >= lo else np.zeros((0,), dtype=np.int64)


def sample_anchors(rng: np.random.Generator, length: int, response_start: int,
                   block_size: int, num_anchors: int) -> np.ndarray:
    """Up to ``num_anchors`` distinct anchors, sorted, drawn uniformly.

    Returns:
        [N] int32 anchor positions, N = min(num_anchors, number of valid anchors).
    """
    candidates = valid_anchors(length, response_start, block_size)
    n = min(num_anchors, candidates.size)
    return np.sort(rng.choice(candidates, size=n, replace=False)).astype(np.int32)


def sample_anchors_after_misses(rng: np.random.Generator, length: int, response_start: int, block_size: int,
                                num_anchors: int, after_misses: np.ndarray, fraction: float) -> np.ndarray:
    """Like :func:`sample_anchors`, with up to ``fraction`` of the anchors drawn from
    ``after_misses`` (positions where generation would start a block: right after a
    miss of the drafter; :func:`next_anchors`), the rest uniformly from the others.

    Returns:
        [N] int32 distinct sorted anchor positions, N = min(num_anchors, valid anchors).
    """
    candidates = valid_anchors(length, response_start, block_size)
    preferred = np.intersect1d(after_misses, candidates)
    k = min(int(round(num_anchors * fraction)), preferred.size, num_anchors)
    chosen = rng.choice(preferred, size=k, replace=False) if k else np.zeros((0,), dtype=np.int64)
    others = np.setdiff1d(candidates, chosen)
    rest = rng.choice(others, size=min(num_anchors - k, others.size), replace=False)
    return np.sort(np.concatenate([chosen, rest])).astype(np.int32)


def next_anchors(anchors: np.ndarray, lengths: np.ndarray, length: int) -> np.ndarray:
    """Where generation would anchor the block after each block: ``anchor + length``
    (length: accepted drafts + 1, 1..B), those inside the sequence, distinct.

    Returns:
        [M] int64 sorted positions.
    """
    return np.unique((anchors + lengths)[anchors + lengths < length]).astype(np.int64)


def block_mask(anchors: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Attention mask of the training forward.

    Args:
        anchors: [N] anchor positions.
        length: L, context rows (positions 0..L-1).
        block_size: B.

    Returns:
        [N, 1, B, L + B] bool: key columns ``0..L-1`` are context positions (visible
        when ``< anchor``), columns ``L..L+B-1`` the block's own rows (all visible).
    """
    n = anchors.shape[0]
    context = np.arange(length)[None, :] < anchors[:, None]  # [N, L]
    context = np.broadcast_to(context[:, None, None, :], (n, 1, block_size, length))
    own = np.ones((n, 1, block_size, block_size), dtype=bool)
    return np.concatenate([context, own], axis=-1)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight of block rows 1..B-1: ``exp(-(k-1)/gamma)`` (spec section 6).

    Returns:
        [B-1] float32.
    """
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def default_gamma(block_size: int) -> float:
    """gamma = 7 for B = 16 and 4 for B = 8 (spec section 6); linear in between."""
    if block_size >= 16:
        return 7.0
    if block_size <= 8:
        return 4.0
    return 4.0 + 3.0 * (block_size - 8) / 8
