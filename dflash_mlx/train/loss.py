"""The training loss (spec section 6) and its inputs: the frozen target's outputs (context features,
spec section 3, and for distillation its final hidden states), cached per sequence; the blocks of a
sequence through one masked forward, row k's cross-entropy weighted by ``exp(-(k-1)/gamma)``."""

from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..drafter.network import DFlashDrafter
from ..drafter.vocab import head_columns
from ..errors import InputError
from ..kernels import fast_softmax
from ..targets import TargetAdapter
from .blocks import block_mask, previous_tokens
from .data import TrainSequence
from .features import FeatureStore


def target_outputs(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> Tuple[mx.array, mx.array]:
    """Context features [1, L, K*H] and final hidden states [1, L, H] (the input of ``target.lm_head``) of
    a whole sequence, one frozen forward, no gradient."""
    hidden, feats = target(mx.array(tokens[None]), [None] * target.num_layers, layer_ids)
    return mx.stop_gradient(feats.astype(dtype)), mx.stop_gradient(hidden.astype(dtype))


def target_features(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> mx.array:
    """[1, L, K*H] context features of a whole sequence."""
    return target_outputs(target, tokens, layer_ids, dtype)[0]


class FeatureCache:
    """Per-sequence target features (with ``hidden`` also final hidden states): read from ``stores`` (kept by
    ``dflash data``) or a ``folder`` (a :class:`FeatureStore` any data may share), else computed by one frozen
    forward and, with a ``folder``, kept there (read again at each visit, never held in memory, so memory does not
    grow with the data). InputError when ``folder`` holds another target's or other layers' features. ``unused``:
    why a given store is not read; ``rebuilt``: unreadable files."""

    def __init__(self, target: TargetAdapter, layer_ids: List[int], folder: Optional[str | Path] = None,
                 hidden: bool = False, stores: Sequence[FeatureStore] = ()):
        self.target, self.layer_ids, self.hidden = target, list(layer_ids), hidden
        self.store = FeatureStore(folder, target, layer_ids, write=True) if folder else None
        if self.store is not None and self.store.mismatch:
            raise InputError(f"{self.store.mismatch}; give another features folder")
        self.stores = [s for s in stores if s.mismatch is None] + ([self.store] if self.store else [])
        self.unused = [s.mismatch for s in stores if s.mismatch is not None]
        self.rebuilt = self.store.unreadable if self.store else []

    def get(self, seq: TrainSequence, dtype) -> Tuple[mx.array, Optional[mx.array]]:
        """Features [1, L, K*H] of ``seq`` and its final hidden states [1, L, H] (or None)."""
        feats = next((f for f in (s.get(seq.tokens) for s in self.stores) if f is not None), None)
        hidden = self.store.get(seq.tokens, "hidden") if self.hidden and self.store else None
        if feats is None or (self.hidden and hidden is None):
            exact = dtype if self.store is None else mx.float32  # what is kept is rounded to float16 once
            f, h = target_outputs(self.target, seq.tokens, self.layer_ids, exact)
            if self.store is None:
                return f, h if self.hidden else None
            self.store.put(seq.tokens, f)
            if self.hidden:
                self.store.put(seq.tokens, h, "hidden")
            feats, hidden = np.array(f.astype(mx.float16)), np.array(h.astype(mx.float16)) if self.hidden else None
        return mx.array(feats).astype(dtype), None if hidden is None else mx.array(hidden).astype(dtype)


def block_targets(seq: TrainSequence, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """[N, B-1] the tokens block rows 1..B-1 of the blocks at ``anchors`` [N] learn to draft."""
    return seq.tokens[anchors[:, None] + np.arange(1, block_size)]


def make_batch(seq: TrainSequence, block_size: int, mask_id: int, anchors: np.ndarray, context: Optional[int] = None):
    """``(blocks [N, B], targets [N, B-1], anchors [N], mask [N, 1, B, L+B])`` for ``anchors``; L =
    ``context`` (default: the whole sequence), at least ``anchors.max()``."""
    blocks = np.full((anchors.size, block_size), mask_id, dtype=np.int32)
    blocks[:, 0] = seq.tokens[anchors]
    targets = block_targets(seq, anchors, block_size)
    mask = block_mask(anchors, seq.tokens.size if context is None else context, block_size)
    return mx.array(blocks), mx.array(targets), mx.array(anchors), mx.array(mask)


def chunk_batches(seq: TrainSequence, features: mx.array, anchors: np.ndarray, block_size: int, mask_id: int,
                  anchor_chunk: int) -> Iterator[Tuple[mx.array, tuple]]:
    """Yields ``(features [1, L_c, K*H], make_batch(...))`` per ``anchor_chunk`` sorted anchors, each chunk
    with the context up to its last anchor (the columns cut are masked anyway)."""
    size = anchor_chunk or anchors.size
    for start in range(0, anchors.size, size):
        part = slice(start, start + size)
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


NEGATIVES = 4096  # tokens outside the data drawn into each step's --loss-vocab data softmax


class LossVocab:
    """The columns a ``--loss-vocab data`` cross-entropy normalizes over: the training data's tokens (``ids``
    [S]; ``index`` [V] maps a token to its column, -1 outside) and ``negatives`` others drawn by :meth:`draw`
    (a sampled softmax: drawn logits raised by log(R / K), R the tokens outside the data, K drawn), so the
    rest of the vocabulary, which drafting's argmax runs over, is pushed down too; (S + K) / V of the head's
    cost (``--loss-vocab step``: :meth:`draw` is given each step's own target tokens as the data).
    ``columns`` [S + K] ids, ``head`` [S + K, H] (the head's rows, gathered whole) and ``shift``: the draw's."""

    def __init__(self, target: TargetAdapter, sequences: List[TrainSequence], dtype, kind: str = "data",
                 negatives: int = NEGATIVES):
        H, self.vocab_size, self.wanted = target.hidden_size, target.vocab_size, negatives
        full = head_columns(target.lm_head, H, mx.float32).astype(mx.float32)  # [H, V]: the head, if linear
        probe = mx.random.normal((4, H), key=mx.random.key(0))
        if not mx.allclose(target.lm_head(probe).astype(mx.float32), probe @ full, rtol=1e-3, atol=1e-3).item():
            raise InputError(f"--loss-vocab {kind} needs a linear output head; this target's is not (softcapping?): "
                             "use --loss-vocab full")
        self.rows = mx.stop_gradient(mx.contiguous(full.T).astype(dtype))  # [V, H]
        self.draw(np.random.default_rng(0), np.concatenate([s.tokens for s in sequences]))

    def draw(self, rng: np.random.Generator, ids: Optional[np.ndarray] = None) -> None:
        """Draw the step's ``negatives`` tokens outside the data (all where there are no more); ``ids``: new data."""
        if ids is not None:
            self.ids, self.rest = np.unique(ids), np.setdiff1d(np.arange(self.vocab_size), ids)
            index = np.full(self.vocab_size, -1, dtype=np.int32)
            index[self.ids] = np.arange(self.ids.size)
            self.index, self.negatives = mx.array(index), min(self.wanted, self.rest.size)
        drawn = self.rest if self.negatives == self.rest.size else rng.choice(self.rest, self.negatives, replace=False)
        raise_by = np.log(self.rest.size / drawn.size) if drawn.size else 0.0
        self.columns = np.concatenate([self.ids, drawn])
        self.head = self.rows[mx.array(self.columns)]
        self.shift = mx.array(np.repeat(np.array([0.0, raise_by], dtype=np.float32), [self.ids.size, drawn.size]))
        mx.eval(self.head, self.shift, self.index)


def block_loss(drafter: DFlashDrafter, features, blocks, targets, anchors, mask, weights,
               num_blocks: Optional[int] = None, target_logits: Optional[mx.array] = None, kl_weight: float = 0.0,
               kl_temperature: float = 1.0, with_lengths: bool = False, vocab: Optional[LossVocab] = None,
               l1_weight: float = 0.0):
    """Cross-entropy of block rows 1..B-1 (plus ``kl_weight`` times :func:`distill_kl` against ``target_logits``
    [N, B-1, V]; DeepSpec's DSpark losses against them: ``l1_weight`` times the L1 distance of the two
    distributions, and a confidence head's binary cross-entropy to 1 - TV) weighted by ``weights`` [B-1], over the
    weight sum times ``num_blocks`` (the sequence's blocks, default N: chunks then sum to the whole); with
    ``vocab`` the softmax runs over its columns only (:class:`LossVocab`; none of those); a DSpark drafter's
    Markov bias is added from the true previous tokens. With ``with_lengths`` also returns each block's greedy
    acceptance length [N] int32 (accepted rows + 1)."""
    hidden, previous = drafter.block_hidden(blocks, features, anchors, mask), previous_tokens(blocks, targets)
    if vocab is None:
        logits = drafter.block_logits(blocks, features, anchors, mask, previous, hidden).astype(mx.float32)
    else:
        logits = (hidden @ vocab.head.T).astype(mx.float32) + vocab.shift
        if "markov_head" in drafter:  # DSpark's bias from the true previous tokens, over the same columns
            logits = logits + drafter.markov_bias(previous, mx.array(vocab.columns))
    labels = targets if vocab is None else vocab.index[targets]
    per_row = fast_softmax.cross_entropy(logits, labels)
    if target_logits is not None and kl_weight:
        per_row = per_row + kl_weight * distill_kl(logits, target_logits, kl_temperature)
    if target_logits is not None and (l1_weight or "confidence_head" in drafter):
        q, p = fast_softmax.softmax(logits), fast_softmax.softmax(target_logits)
        tv = 0.5 * mx.abs(q - p).sum(axis=-1)  # [N, B-1]; 1 - tv: the chance a draft from q is accepted
        per_row = per_row + 2 * l1_weight * tv
        if "confidence_head" in drafter:
            confidence = drafter.confidence(hidden, previous)
            per_row = per_row + nn.losses.binary_cross_entropy(confidence, 1 - mx.stop_gradient(tv), reduction="none")
    loss = (per_row * weights).sum() / (weights.sum() * (num_blocks or blocks.shape[0]))
    if not with_lengths:
        return loss
    right = mx.stop_gradient(logits.argmax(axis=-1) == labels).astype(mx.int32)
    return loss, mx.cumprod(right, axis=-1).sum(axis=-1) + 1


def sequence_loss_and_grad(loss_and_grad: Callable, features: mx.array, seq: TrainSequence, anchors: np.ndarray,
                           block_size: int, mask_id: int, anchor_chunk: int = 0, hidden: Optional[mx.array] = None,
                           target: Optional[TargetAdapter] = None, lengths_out: Optional[List[np.ndarray]] = None):
    """Evaluated ``(loss, grads)`` of ``loss_and_grad`` (``nn.value_and_grad`` of a :func:`block_loss`) over
    every anchor, ``anchor_chunk`` at a time; with distillation's ``hidden`` [1, L, H] and ``target``, the
    ``target_logits`` are passed on; returned ``lengths`` are appended to ``lengths_out``."""
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
