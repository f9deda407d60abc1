"""mlx-lm's sampler, with one rule added for top-k: k at or above the vocabulary size
keeps every token, so it means "no top-k" (mlx-lm refuses such a k)."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

Sampler = Callable[[mx.array], mx.array]


def effective_top_k(top_k: int, vocab_size: Optional[int]) -> int:
    """``top_k``, or 0 (off) when it is at least ``vocab_size`` (nothing to cut)."""
    return 0 if vocab_size is not None and top_k >= vocab_size else top_k


def make_sampler(temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                 vocab_size: Optional[int] = None) -> Sampler:
    """mlx-lm's ``make_sampler(temp, top_p, min_p, 1, top_k=...)`` over [N, V] log-probabilities.

    Args:
        temp: temperature; 0 is greedy.
        top_p, min_p: nucleus mass and min-p threshold (1.0 and 0.0 are off).
        top_k: the k most likely tokens; 0, or ``vocab_size`` and above, is off.
        vocab_size: the target's vocabulary size V (the logits' last dimension).
    """
    return mlx_lm_make_sampler(temp, top_p, min_p, 1, top_k=effective_top_k(top_k, vocab_size))
