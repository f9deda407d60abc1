"""Held-out acceptance as generation sees it: blocks anchored where the previous block's
acceptance ended, not at uniformly drawn positions.

Teacher-forced tau over uniform anchors (:func:`dflash_mlx.train.trainer.evaluate_block_sizes`)
is optimistic: in generation a block starts right after the position where the last one
failed, and positions after a miss are harder than average (on the stories260K pair, 4.86
uniform against 3.77 along the generation's own schedule and 3.74 in real generation, with
the training forward and the engine's drafter giving the same logits at the same anchors;
docs/benchmarks.md, "Training to inference tau gap"). This pass runs the engine's drafter
(cache and all) along each held-out sequence, whose response is the target's own greedy
continuation, so the steps are those greedy generation would take from its prompt.
"""

from __future__ import annotations

from typing import Dict, List

import mlx.core as mx
import numpy as np

from ..protocol import Drafter
from ..targets import TargetAdapter
from .data import TrainSequence


def chained_lengths(drafter: Drafter, features: mx.array, seq: TrainSequence, block_size: int) -> List[int]:
    """Acceptance lengths (accepted drafts + 1, tokens a step commits) along one sequence.

    The first block is anchored at ``response_start`` over the prompt's features, as
    after a prefill; each next block at the last anchor plus the step's length. Blocks
    that would run past the sequence end stop the walk.

    Args:
        drafter: a bound drafter (``make_cache``, ``draft``), as generation runs it.
        features: [1, L, K*H] target features of ``seq`` (the drafter's dtype).

    Returns:
        One length per step, each in 1..B.
    """
    tokens = seq.tokens
    cache, fed, anchor, lengths = drafter.make_cache(), 0, max(seq.response_start, 1), []
    while anchor + block_size <= tokens.size:
        token = mx.array([int(tokens[anchor])], dtype=mx.int32)
        drafts = np.array(drafter.draft(token, features[:, fed:anchor], cache, block_size))  # the engine's greedy draft
        fed = anchor
        right = drafts == tokens[anchor + 1:anchor + block_size]
        step = int(np.cumprod(right).sum()) + 1
        lengths.append(step)
        anchor += step
    return lengths


def evaluate_chained(drafter: Drafter, target: TargetAdapter, sequences: List[TrainSequence],
                     block_sizes: List[int], features: Dict[int, mx.array]) -> Dict[int, dict]:
    """Tau along generation's schedule on held-out sequences, per block size.

    Args:
        features: sequence index -> its [1, L, K*H] features (computed once by the caller).

    Returns:
        ``{block size: {"tau": tokens per step, "steps": n}}`` (tau 1.0 with no step).
    """
    out = {}
    for b in block_sizes:
        lengths = [n for i, seq in enumerate(sequences) if i in features
                   for n in chained_lengths(drafter, features[i], seq, b)]
        out[b] = {"tau": round(float(np.mean(lengths)), 4) if lengths else 1.0, "steps": len(lengths)}
    return out
