"""Anchors, block attention masks and loss weights of drafter training (spec section 6): anchor ``a``
gives the block ``[token[a], MASK x (B-1)]`` at positions ``a..a+B-1``, whose row k predicts ``token[a+k]``."""

from typing import Optional

import mlx.core as mx
import numpy as np


def valid_anchors(length: int, response_start: int, block_size: int) -> np.ndarray:
    """[M] positions that may anchor a block: ``max(response_start, 1) <= a <= length - B``."""
    lo = max(response_start, 1)
    hi = length - block_size
    return np.arange(lo, hi + 1) if hi >= lo else np.zeros((0,), dtype=np.int64)


def sample_anchors(rng: np.random.Generator, length: int, response_start: int, block_size: int, num_anchors: int,
                   after_misses: Optional[np.ndarray] = None, fraction: float = 0.0) -> np.ndarray:
    """[N] int32 distinct sorted anchors, N = min(num_anchors, valid anchors): up to ``fraction`` of them
    drawn from ``after_misses`` (:func:`next_anchors`), the rest uniformly from the others."""
    candidates = valid_anchors(length, response_start, block_size)
    preferred = candidates[:0] if after_misses is None else np.intersect1d(after_misses, candidates)
    k = min(int(round(num_anchors * fraction)), preferred.size, num_anchors)
    chosen = rng.choice(preferred, size=k, replace=False) if k else np.zeros((0,), dtype=np.int64)
    others = np.setdiff1d(candidates, chosen)
    rest = rng.choice(others, size=min(num_anchors - k, others.size), replace=False)
    return np.sort(np.concatenate([chosen, rest])).astype(np.int32)


def next_anchors(anchors: np.ndarray, lengths: np.ndarray, length: int) -> np.ndarray:
    """[M] int64 sorted distinct ``anchors + lengths`` inside the sequence: where generation would anchor
    the next block (lengths: accepted drafts + 1)."""
    return np.unique((anchors + lengths)[anchors + lengths < length]).astype(np.int64)


def block_mask(anchors: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """[N, 1, B, L + B] bool attention mask of the blocks at ``anchors`` [N]: context column p visible
    when ``p < anchor``, the block's own B columns all visible."""
    n = anchors.shape[0]
    context = np.arange(length)[None, :] < anchors[:, None]  # [N, L]
    context = np.broadcast_to(context[:, None, None, :], (n, 1, block_size, length))
    own = np.ones((n, 1, block_size, block_size), dtype=bool)
    return np.concatenate([context, own], axis=-1)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[B-1] float32 loss weights ``exp(-(k-1)/gamma)`` of block rows k = 1..B-1 (spec section 6)."""
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def default_gamma(block_size: int) -> float:
    """gamma = 7 for B = 16 and 4 for B = 8 (spec section 6); linear in between."""
    return 4.0 + 3.0 * (min(max(block_size, 8), 16) - 8) / 8


def previous_tokens(blocks, targets):
    """[N, B-1] int32 (mx): the token before each drafting row's in training, the anchor's then ``targets[:, :-1]``
    (what a DSpark drafter's Markov head reads, teacher forced), of blocks [N, B] and targets [N, B-1]."""
    return mx.concatenate([blocks[:, :1], targets[:, :-1]], axis=1)
