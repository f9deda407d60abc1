"""Held-out acceptance of a drafter in training: teacher-forced over uniform anchors
(:func:`evaluate_block_sizes`), and along greedy generation's own schedule (:func:`evaluate_chained`),
where each block starts where the previous one's acceptance ended."""

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..drafter.network import DFlashDrafter
from ..protocol import Drafter
from ..stats import teacher_forced
from ..targets import TargetAdapter
from .blocks import previous_tokens, sample_anchors
from .data import TrainSequence
from .loss import chunk_batches, target_features


def chained_lengths(drafter: Drafter, features: mx.array, seq: TrainSequence, block_size: int) -> List[int]:
    """Acceptance lengths (accepted drafts + 1) of the engine's drafter along ``seq`` (features [1, L, K*H]):
    blocks from ``response_start``, each next one at the last anchor plus the step's length, while they fit."""
    tokens = seq.tokens
    cache, fed, anchor, lengths = drafter.make_cache(), 0, max(seq.response_start, 1), []
    while anchor + block_size <= tokens.size:
        token = mx.array([int(tokens[anchor])], dtype=mx.int32)
        drafts = np.array(drafter.draft(token, features[:, fed:anchor], cache, block_size))
        fed = anchor
        right = drafts == tokens[anchor + 1:anchor + block_size]
        step = int(np.cumprod(right).sum()) + 1
        lengths.append(step)
        anchor += step
    return lengths


def evaluate_chained(drafter: Drafter, target: TargetAdapter, sequences: List[TrainSequence],
                     block_sizes: List[int], features: Dict[int, mx.array]) -> Dict[int, dict]:
    """``{block size: {"tau": tokens per step (1.0 without a step), "steps": n}}`` of
    :func:`chained_lengths` over ``sequences`` (``features``: index -> [1, L, K*H])."""
    out = {}
    for b in block_sizes:
        lengths = [n for i, seq in enumerate(sequences) if i in features
                   for n in chained_lengths(drafter, features[i], seq, b)]
        out[b] = {"tau": round(float(np.mean(lengths)), 4) if lengths else 1.0, "steps": len(lengths)}
    return out


def evaluate_block_sizes(drafter: DFlashDrafter, target: TargetAdapter, sequences: List[TrainSequence],
                         block_sizes: List[int], max_anchors: int = 256, seed: int = 0, anchor_chunk: int = 64,
                         chained: bool = True, features: Optional[dict] = None) -> Dict[int, dict]:
    """Per block size (in their order), ``{"accuracy": [B-1], "acceptance": [B-1], "tau", "blocks", "per_sequence"}``
    teacher-forced on held-out data (:func:`dflash_mlx.stats.teacher_forced`; ``per_sequence``: ``[blocks, accepted
    drafts]`` per sequence, anchors drawn from ``seed`` and its index alone, the same for any drafter); with ``chained``
    also ``tau_generation`` (:func:`evaluate_chained`). The target runs once per sequence; ``features`` keeps what it
    gives, ``(target_layer_ids, dtype) -> {index: [1, L, K*H]}``, so one dict passed to several drafters serves them."""
    dtype = drafter.fc.weight.dtype
    rows = {b: [[np.zeros((0, b - 1), dtype=bool)] for _ in sequences] for b in block_sizes}
    features = ({} if features is None else features).setdefault((tuple(drafter.target_layer_ids), dtype), {})
    for i, seq in enumerate(sequences):
        for b in block_sizes:
            rng = np.random.default_rng([seed, 7919, i])
            anchors = sample_anchors(rng, seq.tokens.size, seq.response_start, b, max_anchors)
            if anchors.size == 0:
                continue
            if i not in features:
                features[i] = target_features(target, seq.tokens, drafter.target_layer_ids, dtype)
            for context, (blocks, targets, anchors_mx, mask) in chunk_batches(
                    seq, features[i], anchors, b, drafter.args.mask_token_id, anchor_chunk):
                logits = drafter.block_logits(blocks, context, anchors_mx, mask, previous_tokens(blocks, targets))
                rows[b][i].append(np.array(mx.argmax(logits, axis=-1) == targets))
    each = {b: [np.concatenate(r) for r in rows[b]] for b in block_sizes}
    out = {b: {**teacher_forced(np.concatenate(each[b])),
               "per_sequence": [[len(r), int(np.cumprod(r, axis=1).sum())] for r in each[b]]} for b in block_sizes}
    if chained:
        for b, r in evaluate_chained(drafter, target, sequences, block_sizes, features).items():
            out[b]["tau_generation"] = r["tau"]
    return out
