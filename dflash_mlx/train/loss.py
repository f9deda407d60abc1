"""The training loss (spec section 6): all blocks of a sequence through one masked forward, row k's
cross-entropy weighted by ``exp(-(k-1)/gamma)``, plus an optional distillation term."""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from ..drafter.network import DFlashDrafter
from ..kernels import fast_softmax
from ..targets import TargetAdapter
from .blocks import block_mask
from .data import TrainSequence


def make_batch(seq: TrainSequence, block_size: int, mask_id: int, anchors: np.ndarray,
               context: Optional[int] = None):
    """``(blocks [N, B], targets [N, B-1], anchors [N], mask [N, 1, B, L+B])`` for ``anchors``; L =
    ``context`` (default: the whole sequence), at least ``anchors.max()``."""
    k = np.arange(1, block_size)
    blocks = np.full((anchors.size, block_size), mask_id, dtype=np.int32)
    blocks[:, 0] = seq.tokens[anchors]
    targets = seq.tokens[anchors[:, None] + k[None, :]]
    mask = block_mask(anchors, seq.tokens.size if context is None else context, block_size)
    return mx.array(blocks), mx.array(targets), mx.array(anchors), mx.array(mask)


def chunks(n: int, size: int) -> List[slice]:
    """``[0, n)`` in slices of ``size`` (0: one slice)."""
    size = size or n
    return [slice(start, min(start + size, n)) for start in range(0, n, size)] if n else []


def chunk_batches(seq: TrainSequence, features: mx.array, anchors: np.ndarray, block_size: int, mask_id: int,
                  anchor_chunk: int) -> Iterator[Tuple[mx.array, tuple]]:
    """Yields ``(features [1, L_c, K*H], make_batch(...))`` per ``anchor_chunk`` sorted anchors, each chunk
    with the context up to its last anchor (the columns cut are masked anyway)."""
    for part in chunks(anchors.size, anchor_chunk):
        length = int(anchors[part].max())
        yield features[:, :length], make_batch(seq, block_size, mask_id, anchors[part], length)


def target_block_logits(target: TargetAdapter, hidden: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """[N, B-1, V] float32 target logits of block rows 1..B-1 (row k of the block at a: position a + k - 1)
    from final hidden states [1, L, H]; only those rows go through ``target.lm_head``. No gradient."""
    rows = anchors[:, None] + mx.arange(block_size - 1)[None, :]
    return mx.stop_gradient(target.lm_head(hidden[0][rows]).astype(mx.float32))


def distill_kl(logits: mx.array, target_logits: mx.array, temperature: float = 1.0) -> mx.array:
    """``T^2 * KL(p || q)`` per row in nats, p = softmax(target_logits / T), q = softmax(logits / T);
    [..., V] float32 -> [...]."""
    log_p = fast_softmax.log_softmax(target_logits / temperature)
    log_q = fast_softmax.log_softmax(logits / temperature)
    return (fast_softmax.exp(log_p) * (log_p - log_q)).sum(axis=-1) * temperature**2


def block_loss(drafter: DFlashDrafter, features, blocks, targets, anchors, mask, weights,
               num_blocks: Optional[int] = None, target_logits: Optional[mx.array] = None,
               kl_weight: float = 0.0, kl_temperature: float = 1.0, with_lengths: bool = False):
    """Cross-entropy of block rows 1..B-1 (plus ``kl_weight`` times :func:`distill_kl` against
    ``target_logits`` [N, B-1, V]) weighted by ``weights`` [B-1], over the weight sum times ``num_blocks``
    (the sequence's blocks, default N: chunks then sum to the whole). With ``with_lengths`` also
    returns each block's greedy acceptance length [N] int32 (accepted rows + 1)."""
    logits = drafter.block_logits(blocks, features, anchors, mask).astype(mx.float32)
    per_row = fast_softmax.cross_entropy(logits, targets)
    if target_logits is not None and kl_weight:
        per_row = per_row + kl_weight * distill_kl(logits, target_logits, kl_temperature)
    loss = (per_row * weights).sum() / (weights.sum() * (num_blocks or blocks.shape[0]))
    if not with_lengths:
        return loss
    right = mx.stop_gradient(logits.argmax(axis=-1) == targets).astype(mx.int32)
    return loss, mx.cumprod(right, axis=-1).sum(axis=-1) + 1


def sequence_loss_and_grad(loss_and_grad: Callable, features: mx.array, seq: TrainSequence, anchors: np.ndarray,
                           block_size: int, mask_id: int, anchor_chunk: int = 0,
                           hidden: Optional[mx.array] = None, target: Optional[TargetAdapter] = None,
                           lengths_out: Optional[List[np.ndarray]] = None):
    """Evaluated ``(loss, grads)`` over every anchor of one sequence, ``anchor_chunk`` at a time (one
    chunk's graph alive at a time).

    Args:
        loss_and_grad: ``nn.value_and_grad(drafter, f)``, f as :func:`block_loss` (returning
            ``(loss, lengths)`` appends each chunk's lengths to ``lengths_out``).
        hidden, target: for distillation, final hidden states [1, L, H] and the target whose head makes
            the ``target_logits`` passed on.
    """
    loss, grads = None, None
    for context, batch in chunk_batches(seq, features, anchors, block_size, mask_id, anchor_chunk):
        extra = () if hidden is None else (target_block_logits(target, hidden, batch[2], block_size),)
        value, part_grads = loss_and_grad(context, *batch, anchors.size, *extra)
        part_loss, lengths = value if isinstance(value, tuple) else (value, None)
        if lengths is not None and lengths_out is not None:
            lengths_out.append(lengths)
        loss = part_loss if loss is None else loss + part_loss
        grads = part_grads if grads is None else tree_map(mx.add, grads, part_grads)
        mx.eval(loss, grads, lengths if lengths is not None else [])
    return loss, grads
