# Over 400 lines: the trainer and what one training step uses (feature cache, batches, losses, evaluation)
"""Train a DFlash drafter against a frozen target (DFLASH_SPEC.md section 6).

The target is frozen and so are the embedding and head the drafter borrows from it;
only ``fc``, ``hidden_norm``, the drafter layers and ``norm`` learn. Each step draws
random anchors per sequence, runs all blocks of a sequence in one masked forward
and weights the cross-entropy of block row k by ``exp(-(k-1)/gamma)``.

Two additions to the paper's recipe, each switchable:
- distillation (``kl_weight``): a KL term between the target's next-token
  distribution and the drafter's, on the same block rows, beside the cross-entropy;
- several block sizes in one run (``block_sizes``): each sequence trains at one size
  drawn from the list, so one drafter serves block sizes below the trained one.

Determinism: the data order and the anchors of step s come from NumPy generators
seeded with ``(seed, epoch)`` and ``(seed, s, micro)``, and the optimizer state is
checkpointed, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..atomic import atomic_file, staging
from ..owned import MARKER, mark, marked
from ..drafter.checkpoint import load_drafter, save_drafter
from ..drafter.network import DFlashDrafter
from ..drafter.config import DrafterArgs, default_target_layer_ids
from ..errors import InputError, MismatchError
from ..ranges import check_number
from ..pair.manifest import sha256_file
from ..kernels import fast_softmax
from ..pair.loading import bind_drafter
from ..stats import teacher_forced
from ..targets import TargetAdapter
from .chained import evaluate_chained
from .blocks import (block_mask, default_gamma, next_anchors, position_weights, sample_anchors,
                     sample_anchors_after_misses, valid_anchors)
from .data import TrainSequence, read_json

CHECKPOINTS = "checkpoints"
WRITER = "train"  # the mark of a training run's --out (dflash_mlx.owned)
AFTER_MISSES = "after_misses.npz"  # a checkpoint's anchors after misses (--miss-anchors)
FEATURES = "features"
# Settings that shape a run (schedule, data order, anchors, numerics), with their flags:
# a resumed run must use the checkpoint's values to continue the same run.
RUN_SETTINGS = {"steps": "--steps", "grad_accum": "--grad-accum", "anchors": "--anchors", "lr": "--lr",
                "warmup": "--warmup", "min_lr": "min_lr", "weight_decay": "weight_decay",
                "grad_clip": "--grad-clip", "gamma": "--gamma", "dtype": "--dtype", "seed": "--seed",
                "block_sizes": "--block-sizes", "kl_weight": "--kl-weight", "kl_temperature": "--kl-temperature",
                "miss_anchors": "--miss-anchors"}


@dataclass
class TrainConfig:
    """Training settings (defaults follow the paper where it gives them).

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per micro-batch forward is 1; ``grad_accum``
            sequences make one optimizer step.
        anchors: blocks sampled per sequence (paper: up to 512).
        anchor_chunk: blocks per forward and backward (0: all of a sequence at
            once). Memory grows with it (the [chunk, B-1, V] logits above all);
            the loss and gradients do not depend on it, up to float rounding.
        lr, warmup, min_lr: AdamW peak rate, warm-up fraction of ``steps``,
            and the cosine floor.
        grad_clip: max global gradient norm.
        gamma: loss decay over block rows: one value for every block size, one
            per entry of ``block_sizes``, or None for :func:`default_gamma`.
        dtype: "float32" or "bfloat16" for the drafter's weights and features.
        block_sizes: block sizes to train, one drawn uniformly per sequence
            (repeat a size to draw it more often); None: the drafter's only.
        kl_weight: weight of the distillation term (0: cross-entropy only).
        kl_temperature: temperature T of both distributions in that term.
        miss_anchors: fraction of a sequence's anchors drawn from the positions
            where generation would start a block, right after a miss of the
            drafter on the sequence's previous visit (0: uniform anchors only).
        eval_every, save_every: in optimizer steps (0 = never).
    """

    steps: int = 1000
    grad_accum: int = 1
    anchors: int = 512
    anchor_chunk: int = 64
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr: float = 0.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: Optional[Union[float, List[float]]] = None
    dtype: str = "float32"
    seed: int = 0
    block_sizes: Optional[List[int]] = None
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    miss_anchors: float = 0.0
    eval_every: int = 0
    eval_sequences: int = 16
    save_every: int = 0
    keep_checkpoints: int = 3

    def check(self) -> None:
        """Range checks of every setting, before anything is loaded.

        Raises:
            InputError: naming the flag of the first setting out of range (NaN and
                infinities included).
        """
        flag = {**RUN_SETTINGS, "anchor_chunk": "--anchor-chunk", "eval_every": "--eval-every",
                "save_every": "--save-every", "eval_sequences": "--held-out", "keep_checkpoints": "keep_checkpoints"}
        for name in ("steps", "grad_accum", "anchors", "keep_checkpoints"):
            check_number(flag[name], getattr(self, name), at_least=1)
        for name in ("anchor_chunk", "eval_every", "save_every", "eval_sequences", "min_lr", "weight_decay",
                     "kl_weight"):
            check_number(flag[name], getattr(self, name), at_least=0)
        for name in ("lr", "grad_clip", "kl_temperature"):
            check_number(flag[name], getattr(self, name), above=0)
        check_number("--warmup", self.warmup, at_least=0, at_most=1, rule="a fraction from 0 to 1")
        check_number("--miss-anchors", self.miss_anchors, at_least=0, at_most=1, rule="a fraction from 0 to 1")
        check_number("--seed", self.seed, at_least=0, at_most=2**64 - 1)
        gammas = self.gamma if isinstance(self.gamma, (list, tuple)) else [self.gamma]
        for g in gammas:
            check_number("--gamma", g, above=0)
        for b in self.block_sizes or ():
            check_number("--block-sizes", b, at_least=2)


@dataclass
class StepInfo:
    """One optimizer step: ``loss`` (weighted CE, plus the weighted KL term when
    distilling), ``lr``, ``tokens_per_s`` (trained block tokens per second), ``eval``
    (set on evaluation steps: :func:`evaluate`'s result per trained block size,
    largest first)."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    eval: Optional[Dict[int, dict]] = None


def target_fingerprint(target: TargetAdapter) -> dict:
    """What must match when resuming: family, sizes and vocabulary."""
    return {"model_type": getattr(target.model, "model_type", ""), "hidden_size": target.hidden_size,
            "num_layers": target.num_layers, "vocab_size": target.vocab_size}


def pick_mask_token(tokenizer, vocab_size: int, sequences: List[TrainSequence]) -> int:
    """An unused vocabulary id for MASK.

    Preference: a row past the tokenizer's pieces (``len(tokenizer) .. vocab-1``, as
    in the released Qwen3 drafters); else the highest non-special id that never occurs
    in the training data; else, when every id occurs, the least frequent non-special
    id (the drafter still works: MASK only needs a fixed embedding, but that token's
    own meaning is blurred for the drafter).
    """
    size = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else vocab_size
    if size < vocab_size:
        return vocab_size - 1
    counts = np.bincount(np.concatenate([s.tokens for s in sequences]), minlength=vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(tokenizer.eos_token_ids)
    order = [i for i in np.argsort(counts, kind="stable")[::-1] if i not in special]
    unused = [i for i in range(vocab_size - 1, -1, -1) if counts[i] == 0 and i not in special]
    return int(unused[0]) if unused else int(order[-1])


def init_drafter(target: TargetAdapter, mask_token_id: int, layers: int = 1, block_size: int = 16,
                 target_layer_ids: Optional[List[int]] = None, intermediate_size: Optional[int] = None,
                 seed: int = 0) -> DFlashDrafter:
    """A fresh drafter shaped like the target's layers (hidden size = the target's).

    ``target_layer_ids`` defaults to ids spread evenly; any list of valid layers works.

    Raises:
        InputError: a layer id outside the target, or a mask id outside the vocabulary.
    """
    a = target.args
    n_heads = a.num_attention_heads
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, layers)
    if min(ids) < 0 or max(ids) >= target.num_layers:
        raise InputError(f"--target-layer-ids {ids}: the target has layers 0..{target.num_layers - 1}")
    if not 0 <= mask_token_id < target.vocab_size:
        raise InputError(f"--mask-token-id {mask_token_id} is outside the vocabulary [0, {target.vocab_size})")
    args = DrafterArgs(
        hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=n_heads,
        num_key_value_heads=getattr(a, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(a, "head_dim", None) or target.hidden_size // n_heads,
        intermediate_size=intermediate_size or a.intermediate_size, vocab_size=target.vocab_size,
        target_layer_ids=list(ids), mask_token_id=mask_token_id, block_size=block_size,
        num_target_layers=target.num_layers, rms_norm_eps=getattr(a, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),
        max_position_embeddings=getattr(a, "max_position_embeddings", None) or 40960,
    )
    mx.random.seed(seed)
    drafter = DFlashDrafter(args)
    mx.eval(drafter.parameters())
    return bind_drafter(drafter, target)


def target_features(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> mx.array:
    """[1, L, K*H] frozen context features of a whole sequence."""
    return target_outputs(target, tokens, layer_ids, dtype)[0]


def target_outputs(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> Tuple[mx.array, mx.array]:
    """Context features [1, L, K*H] and final hidden states [1, L, H] (after the final
    norm, the input of ``target.lm_head``) of a whole sequence, from one frozen forward."""
    hidden, feats = target(mx.array(tokens[None]), [None] * target.num_layers, layer_ids)
    return mx.stop_gradient(feats.astype(dtype)), mx.stop_gradient(hidden.astype(dtype))


def target_block_logits(target: TargetAdapter, hidden: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """The target's own logits for block rows 1..B-1: row k of the block at anchor a
    predicts the token at a + k, as the target's logits at position a + k - 1 do.

    Only these rows go through ``target.lm_head``, so memory is that of the drafter's
    own block logits ([N, B-1, V] for N anchors), whatever the vocabulary.

    Args:
        hidden: [1, L, H] final hidden states (:func:`target_outputs`).
        anchors: [N] int32 anchor positions.

    Returns:
        [N, B-1, V] float32 logits, no gradient.
    """
    rows = anchors[:, None] + mx.arange(block_size - 1)[None, :]
    return mx.stop_gradient(target.lm_head(hidden[0][rows]).astype(mx.float32))


class FeatureCache:
    """Target features per training sequence, computed once and kept on disk
    (float16 ``.npy``) and in memory. Without a folder, features are computed on
    the fly every time.

    For distillation the cache also keeps the target's final hidden states (H values
    per position, ``NNNNNNN.hidden.npy``), not its logits: logits would take V values
    per position (151,936 for Qwen3), and a top-k cut would make the KL term
    approximate. The loss turns the hidden rows it needs into logits with the
    target's own head, one anchor chunk at a time (:func:`target_block_logits`).
    """

    def __init__(self, target: TargetAdapter, layer_ids: List[int], folder: Optional[str | Path] = None,
                 hidden: bool = False, sequences: Optional[List[TrainSequence]] = None):
        """
        Args:
            sequences: the sequences the indices of :meth:`get` refer to; a folder
                records their fingerprint (with the target's and the layer ids), so a
                folder shared between runs is only reused for the same data.

        Raises:
            InputError: the folder holds features of other data, layers or target.
        """
        self.target, self.layer_ids, self.hidden = target, list(layer_ids), hidden
        self.folder = Path(folder) if folder else None
        self.memory: Dict[int, Tuple[np.ndarray, Optional[np.ndarray]]] = {}
        self.rebuilt: List[Path] = []  # cached files found unreadable and computed again
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_manifest(sequences)

    def _check_manifest(self, sequences: Optional[List[TrainSequence]]) -> None:
        digest = hashlib.sha256()
        for seq in sequences or []:
            digest.update(seq.tokens.astype(np.int32).tobytes() + b"|")
        key = {"target": target_fingerprint(self.target), "target_layer_ids": self.layer_ids,
               "sequences": digest.hexdigest() if sequences is not None else None}
        path = self.folder / "manifest.json"
        if path.is_file():
            if read_json(path, "delete the features folder (it is made again)") != key:
                raise InputError(f"{self.folder}: holds target features of other data, target_layer_ids or target; "
                                 "give another features folder")
        else:
            with atomic_file(path) as tmp:
                tmp.write_text(json.dumps(key, indent=2))

    def _load(self, path: Path, length: int) -> Optional[np.ndarray]:
        """The cached array, or None when it is missing, of another length, or unreadable
        (a truncated file from before writes were atomic: it is computed again)."""
        if not path.is_file():
            return None
        try:
            cached = np.load(path)
        except (ValueError, OSError, EOFError):
            self.rebuilt.append(path)
            return None
        if cached.ndim != 3 or cached.shape[1] != length:
            return None
        return cached

    @staticmethod
    def _save(path: Path, array: np.ndarray) -> None:
        with atomic_file(path) as tmp, open(tmp, "wb") as f:  # a kill never leaves half a file
            np.save(f, array)

    def get(self, index: int, seq: TrainSequence, dtype) -> Tuple[mx.array, Optional[mx.array]]:
        """Features [1, L, K*H] of sequence ``index``, and its final hidden states
        [1, L, H] when the cache keeps them (else None)."""
        if self.folder is None:
            feats, hidden = target_outputs(self.target, seq.tokens, self.layer_ids, dtype)
            return feats, hidden if self.hidden else None
        if index not in self.memory:
            path = self.folder / f"{index:07d}.npy"
            feats = self._load(path, seq.tokens.size)
            hidden = self._load(path.with_suffix(".hidden.npy"), seq.tokens.size) if self.hidden else None
            if feats is None or (self.hidden and hidden is None):
                f, h = target_outputs(self.target, seq.tokens, self.layer_ids, mx.float32)
                feats, hidden = np.array(f.astype(mx.float16)), np.array(h.astype(mx.float16))
                self._save(path, feats)
                if self.hidden:
                    self._save(path.with_suffix(".hidden.npy"), hidden)
            self.memory[index] = (feats, hidden if self.hidden else None)
        feats, hidden = self.memory[index]
        return mx.array(feats).astype(dtype), None if hidden is None else mx.array(hidden).astype(dtype)


def final_drafter_problem(out: Path, ckpt: Path) -> Optional[str]:
    """Why the drafter in ``out`` is not the one of the final checkpoint ``ckpt`` (both
    are written by ``save_drafter`` from the same weights, so they are equal byte for
    byte), or None when it is."""
    for name in ("config.json", "model.safetensors"):
        if not (out / name).is_file():
            return f"{out / name} is missing"
        if sha256_file(out / name) != sha256_file(ckpt / name):  # (filecmp caches by size and mtime)
            return f"{out / name} differs from {ckpt / name} (corrupt or half written)"
    return None


def make_batch(seq: TrainSequence, block_size: int, mask_id: int, anchors: np.ndarray,
               context: Optional[int] = None):
    """Blocks, targets and mask for the anchors of one sequence.

    Args:
        context: L, the context rows the mask covers (default: the whole sequence);
            at least ``anchors.max()``, as no block sees a row at or past its anchor.

    Returns:
        ``(blocks [N, B], targets [N, B-1], anchors [N], mask [N, 1, B, L+B])``.
    """
    k = np.arange(1, block_size)
    blocks = np.full((anchors.size, block_size), mask_id, dtype=np.int32)
    blocks[:, 0] = seq.tokens[anchors]
    targets = seq.tokens[anchors[:, None] + k[None, :]]
    mask = block_mask(anchors, seq.tokens.size if context is None else context, block_size)
    return mx.array(blocks), mx.array(targets), mx.array(anchors), mx.array(mask)


def chunk_batches(seq: TrainSequence, features: mx.array, anchors: np.ndarray, block_size: int, mask_id: int,
                  anchor_chunk: int) -> Iterator[Tuple[mx.array, tuple]]:
    """The anchors of one sequence, ``anchor_chunk`` at a time, each chunk with the
    context it can see: features up to its last anchor (:func:`make_batch`).

    Sorted anchors (as :func:`sample_anchors` gives them) make the early chunks'
    context short, so the attention scores of a sequence shrink by about 40% in
    chunks of 16, with the same result (the columns cut are masked).

    Yields:
        ``(features [1, L_c, K*H], (blocks, targets, anchors, mask))`` per chunk.
    """
    for part in chunks(anchors.size, anchor_chunk):
        length = int(anchors[part].max())
        yield features[:, :length], make_batch(seq, block_size, mask_id, anchors[part], length)


def distill_kl(logits: mx.array, target_logits: mx.array, temperature: float = 1.0) -> mx.array:
    """``T^2 * KL(p || q)`` per row, p = softmax(target_logits / T) (the target's
    distribution), q = softmax(logits / T) (the drafter's).

    The ``T^2`` factor keeps the gradient's scale the same at every temperature
    (Hinton et al., 2015). Zero where the two distributions are equal.

    Args:
        logits, target_logits: [..., V] float32.

    Returns:
        [...] float32, nats.
    """
    log_p = fast_softmax.log_softmax(target_logits / temperature)
    log_q = fast_softmax.log_softmax(logits / temperature)
    return (fast_softmax.exp(log_p) * (log_p - log_q)).sum(axis=-1) * temperature**2


def block_loss(drafter: DFlashDrafter, features, blocks, targets, anchors, mask, weights,
               num_blocks: Optional[int] = None, target_logits: Optional[mx.array] = None,
               kl_weight: float = 0.0, kl_temperature: float = 1.0, with_lengths: bool = False):
    """Weighted cross-entropy of block rows 1..B-1 (plus ``kl_weight`` times the
    distillation term :func:`distill_kl` where ``target_logits`` are given),
    normalised by the weight sum.

    Args:
        weights: [B-1] row weights (:func:`position_weights`).
        num_blocks: blocks of the whole sequence when these are one chunk of them
            (default: ``blocks.shape[0]``), so the chunks' losses sum to the loss
            of all blocks at once.
        target_logits: [N, B-1, V] the target's logits at the same rows
            (:func:`target_block_logits`).
        with_lengths: also return each block's acceptance length under greedy
            drafting ([N] int32, accepted rows + 1), for anchors after misses.

    Returns:
        The scalar loss, or ``(loss, lengths)`` with ``with_lengths``.
    """
    logits = drafter.block_logits(blocks, features, anchors, mask).astype(mx.float32)
    per_row = fast_softmax.cross_entropy(logits, targets)  # nn.losses' exp is slow on CPUs
    if target_logits is not None and kl_weight:
        per_row = per_row + kl_weight * distill_kl(logits, target_logits, kl_temperature)
    loss = (per_row * weights).sum() / (weights.sum() * (num_blocks or blocks.shape[0]))
    if not with_lengths:
        return loss
    right = mx.stop_gradient(logits.argmax(axis=-1) == targets).astype(mx.int32)
    return loss, mx.cumprod(right, axis=-1).sum(axis=-1) + 1


def chunks(n: int, size: int) -> List[slice]:
    """``[0, n)`` in slices of ``size`` (0: one slice)."""
    size = size or n
    return [slice(start, min(start + size, n)) for start in range(0, n, size)] if n else []


def sequence_loss_and_grad(loss_and_grad: Callable, features: mx.array, seq: TrainSequence, anchors: np.ndarray,
                           block_size: int, mask_id: int, anchor_chunk: int = 0,
                           hidden: Optional[mx.array] = None, target: Optional[TargetAdapter] = None,
                           lengths_out: Optional[List[np.ndarray]] = None):
    """Loss and gradients over every anchor of one sequence, ``anchor_chunk`` at a time.

    Each chunk's loss is normalised by the sequence's anchor count, so the chunks
    sum to the loss of one pass over all anchors; their gradients are summed and
    evaluated chunk by chunk, so only one chunk's graph is alive at a time (the
    target's logits for distillation too: they are made per chunk).

    Args:
        loss_and_grad: ``nn.value_and_grad(drafter, f)`` with ``f(features, blocks,
            targets, anchors, mask, num_blocks[, target_logits])`` as :func:`block_loss`.
        features: [1, L, K*H] target features of ``seq``.
        anchors: [N] anchor positions.
        hidden, target: for distillation, the target's final hidden states
            [1, L, H] of ``seq`` and the target whose head turns them into logits;
            ``target_logits`` is then passed to ``loss_and_grad``.
        lengths_out: where ``loss_and_grad`` returns ``(loss, lengths)`` (block
            lengths, as :func:`block_loss` ``with_lengths``), each chunk's lengths
            are appended here.

    Returns:
        ``(loss, grads)``, evaluated.
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


def evaluate(drafter: DFlashDrafter, target: TargetAdapter, sequences: List[TrainSequence],
             block_size: int, max_anchors: int = 256, seed: int = 0, anchor_chunk: int = 64) -> dict:
    """Per-position accuracy and acceptance, and the acceptance length they imply,
    on held-out data (:func:`dflash_mlx.stats.teacher_forced`).

    Returns:
        ``{"accuracy": [B-1], "acceptance": [B-1], "tau": float, "blocks": N}``.
    """
    return evaluate_block_sizes(drafter, target, sequences, [block_size], max_anchors, seed, anchor_chunk)[block_size]


def evaluate_block_sizes(drafter: DFlashDrafter, target: TargetAdapter, sequences: List[TrainSequence],
                         block_sizes: List[int], max_anchors: int = 256, seed: int = 0,
                         anchor_chunk: int = 64, chained: bool = True) -> Dict[int, dict]:
    """:func:`evaluate` at several block sizes, with one target forward per sequence.

    Args:
        chained: also tau along generation's own schedule (``tau_generation``,
            :mod:`dflash_mlx.train.chained`), which the uniform anchors overestimate.

    Returns:
        ``{block size: {"accuracy", "acceptance", "tau", "blocks"[, "tau_generation"]}}``
        in the order of ``block_sizes``.
    """
    dtype = drafter.fc.weight.dtype
    rows = {b: [np.zeros((0, b - 1), dtype=bool)] for b in block_sizes}
    features = {}
    for i, seq in enumerate(sequences):
        for b in block_sizes:
            rng = np.random.default_rng([seed, 7919, i])
            anchors = sample_anchors(rng, seq.tokens.size, seq.response_start, b, max_anchors)
            if anchors.size == 0:
                continue
            if i not in features:
                features[i] = target_features(target, seq.tokens, drafter.target_layer_ids, dtype)
            for context, (blocks, targets, anchors_mx, mask) in chunk_batches(  # bounded memory, as in training
                    seq, features[i], anchors, b, drafter.args.mask_token_id, anchor_chunk):
                logits = drafter.block_logits(blocks, context, anchors_mx, mask)
                rows[b].append(np.array(mx.argmax(logits, axis=-1) == targets))
    out = {b: teacher_forced(np.concatenate(rows[b])) for b in block_sizes}
    if chained:
        for b, r in evaluate_chained(drafter, target, sequences, block_sizes, features).items():
            out[b]["tau_generation"] = r["tau"]
    return out


def block_size_plan(config: TrainConfig, trained: int) -> Dict[int, float]:
    """The block sizes a run trains and the loss decay gamma of each.

    Args:
        trained: the drafter's block size (the largest it may draft).

    Returns:
        ``{block size: gamma}`` in the order of ``config.block_sizes`` (default:
        ``trained`` only).

    Raises:
        InputError: a block size outside ``2..trained`` or given twice, or a gamma
            list whose length differs from the block sizes'.
    """
    sizes = list(config.block_sizes or [trained])
    bad = [b for b in sizes if not 2 <= b <= trained]
    if bad or len(set(sizes)) != len(sizes):
        raise InputError(f"--block-sizes {','.join(map(str, sizes))}: want distinct sizes from 2 to the "
                         f"drafter's block size {trained}")
    gamma = config.gamma
    if isinstance(gamma, (list, tuple)):
        if len(gamma) != len(sizes):
            raise InputError(f"--gamma {','.join(map(str, gamma))}: give one value, or one per block size "
                             f"({','.join(map(str, sizes))})")
        return dict(zip(sizes, map(float, gamma)))
    return {b: float(gamma) if gamma is not None else default_gamma(b) for b in sizes}


def check_fresh_out(out_dir: str | Path, overwrite: bool = False) -> None:
    """Before a fresh run: ``out_dir`` must not hold an earlier run, whose checkpoints a
    later ``--resume`` would pick up (and whose cached features belong to other data).

    With ``overwrite``, that run's checkpoints, cached features and drafter are deleted,
    and only when a training run marked the folder as its own (:mod:`dflash_mlx.owned`).

    Raises:
        InputError: ``out_dir`` is a file, or holds a run and ``overwrite`` is False, or
            holds such files without the mark of a training run.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; give a folder for the drafter")
    owned = [out / CHECKPOINTS, out / FEATURES, out / "config.json", out / "model.safetensors"]
    found = [p for p in owned if p.exists()]
    if not found:
        return
    if not overwrite:
        ckpts = Trainer.checkpoints(out)
        what = f"checkpoints up to {ckpts[-1].name}" if ckpts else ", ".join(p.name for p in found)
        raise InputError(f"--out {out}: holds an earlier training run ({what}); pass --resume to continue it, "
                         "--overwrite to delete it and start afresh, or a new --out")
    if not marked(out, WRITER):
        raise InputError(f"--out {out}: holds {', '.join(p.name for p in found)} that dflash train did not write "
                         f"(no {MARKER}); --overwrite deletes only a training run's files: give a new --out")
    for p in found:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def learning_rate(config: TrainConfig) -> Callable:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    warm = max(1, int(config.warmup * config.steps))
    return optim.join_schedules(
        [optim.linear_schedule(0.0, config.lr, warm),
         optim.cosine_decay(config.lr, max(1, config.steps - warm), config.min_lr)],
        [warm],
    )


class Trainer:
    """Runs the optimisation; a generator of :class:`StepInfo` (UI stays outside).

    Args:
        drafter: bound to ``target`` (from :func:`init_drafter` or a resumed checkpoint).
        sequences: training data; ``held_out`` evaluation data.
        out_dir: the final drafter is written here, checkpoints under ``checkpoints/``.
    """

    def __init__(self, drafter: DFlashDrafter, target: TargetAdapter, sequences: List[TrainSequence],
                 config: TrainConfig, out_dir: str | Path, held_out: Optional[List[TrainSequence]] = None,
                 feature_cache: Optional[str | Path] = None):
        config.check()
        B = drafter.block_size
        self.plan = block_size_plan(config, B)
        usable = [s for s in sequences if valid_anchors(s.tokens.size, s.response_start, B).size]
        if not usable:
            raise InputError(f"no training sequence is long enough for block size {B}")
        self.drafter, self.target, self.sequences, self.config = drafter, target, usable, config
        self.held_out = held_out or []
        self.out = Path(out_dir)
        self.dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[config.dtype]
        drafter.set_dtype(self.dtype)
        self.weights = {b: mx.array(position_weights(b, gamma)) for b, gamma in self.plan.items()}
        self.optimizer = optim.AdamW(learning_rate=learning_rate(config), weight_decay=config.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        self.features = FeatureCache(target, drafter.target_layer_ids, feature_cache, hidden=config.kl_weight > 0,
                                     sequences=usable)
        self.step = 0
        self.after_misses: Dict[int, np.ndarray] = {}  # sequence index -> next_anchors of its last visit
        self._loss_and_grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, features, blocks, targets, anchors, mask, num_blocks, target_logits=None):
        c = self.config
        return block_loss(self.drafter, features, blocks, targets, anchors, mask, self.weights[blocks.shape[1]],
                          num_blocks, target_logits, c.kl_weight, c.kl_temperature, with_lengths=c.miss_anchors > 0)

    def _sequence(self, index: int) -> int:
        epoch, i = divmod(index, len(self.sequences))
        return int(np.random.default_rng([self.config.seed, epoch]).permutation(len(self.sequences))[i])

    def block_size_at(self, step: int, micro: int) -> int:
        """The block size sequence ``micro`` of ``step`` trains at (drawn from its own
        generator, so a run with one block size draws the same anchors as before)."""
        sizes = list(self.plan)
        if len(sizes) == 1:
            return sizes[0]
        return sizes[int(np.random.default_rng([self.config.seed, step, micro, 1]).integers(len(sizes)))]

    def _micro_step(self, step: int, micro: int):
        c = self.config
        B = self.block_size_at(step, micro)
        index = self._sequence(step * c.grad_accum + micro)
        seq = self.sequences[index]
        rng = np.random.default_rng([c.seed, step, micro])
        if index in self.after_misses:
            anchors = sample_anchors_after_misses(rng, seq.tokens.size, seq.response_start, B, c.anchors,
                                                  self.after_misses[index], c.miss_anchors)
        else:
            anchors = sample_anchors(rng, seq.tokens.size, seq.response_start, B, c.anchors)
        feats, hidden = self.features.get(index, seq, self.dtype)
        lengths = []
        loss, grads = sequence_loss_and_grad(self._loss_and_grad, feats, seq, anchors, B,
                                             self.drafter.args.mask_token_id, c.anchor_chunk, hidden, self.target,
                                             lengths)
        if lengths:
            self.after_misses[index] = next_anchors(anchors, np.concatenate([np.array(x) for x in lengths]),
                                                    seq.tokens.size)
        return loss, grads, anchors.size * (B - 1)

    def run(self) -> Iterator[StepInfo]:
        """Train from ``self.step`` to ``config.steps``, yielding after every step.

        Raises:
            WriteError: a checkpoint or the drafter could not be written (any errno, or
                MLX's RuntimeError); the earlier checkpoints are whole.
        """
        c = self.config
        if not marked(self.out, WRITER):
            mark(self.out, WRITER)  # so that --overwrite may later delete what this run writes
        while self.step < c.steps:
            tic = time.perf_counter()
            total, grads_sum, tokens = 0.0, None, 0
            for micro in range(c.grad_accum):
                loss, grads, n = self._micro_step(self.step, micro)
                grads_sum = grads if grads_sum is None else tree_map(mx.add, grads_sum, grads)
                total, tokens = total + loss, tokens + n
                mx.eval(grads_sum, total)  # else every micro-step's graph stays alive until the update
            grads = tree_map(lambda g: g / c.grad_accum, grads_sum)
            grads, _ = optim.clip_grad_norm(grads, c.grad_clip)
            lr = self.optimizer.learning_rate.item()
            self.optimizer.update(self.drafter, grads)
            mx.eval(self.drafter.parameters(), self.optimizer.state, total)
            self.step += 1
            info = StepInfo(self.step, float(total) / c.grad_accum, lr, tokens / (time.perf_counter() - tic))
            if c.eval_every and self.held_out and self.step % c.eval_every == 0:
                info.eval = evaluate_block_sizes(self.drafter, self.target, self.held_out[: c.eval_sequences],
                                                 sorted(self.plan, reverse=True), seed=c.seed,
                                                 anchor_chunk=c.anchor_chunk,
                                                 chained=self.step == c.steps)  # the last only: ~1 s per sequence
            if c.save_every and self.step % c.save_every == 0:
                self.save_checkpoint()
            yield info
        save_drafter(self.drafter, self.out)

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNNN/`` atomically (:func:`~dflash_mlx.atomic.staging`);
        keep the newest few.

        Raises:
            WriteError: the checkpoint could not be written (any errno, or MLX's
                RuntimeError); the earlier checkpoints and the in-memory state are as they were.
        """
        root = self.out / CHECKPOINTS
        final = root / f"step_{self.step:07d}"
        state = {"step": self.step, "config": asdict(self.config), "target": target_fingerprint(self.target)}
        with staging(final, force=True) as tmp:
            save_drafter(self.drafter, tmp)
            with atomic_file(tmp / "optimizer.npz") as f:
                mx.savez(str(f), **dict(tree_flatten(self.optimizer.state)))
            if self.after_misses:  # so a resumed run draws the same anchors
                with atomic_file(tmp / AFTER_MISSES) as f:
                    np.savez(f, **{str(i): a for i, a in self.after_misses.items()})
            with atomic_file(tmp / "trainer_state.json") as f:
                f.write_text(json.dumps(state, indent=2))
        for old in sorted(root.glob("step_*"))[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    rebuilding: Optional[str] = None  # set by resume(): why the finished run's drafter is written again

    @staticmethod
    def checkpoints(out_dir: str | Path) -> List[Path]:
        """The checkpoints in ``out_dir/checkpoints``, oldest first (each loads with
        ``--draft-model``)."""
        return sorted((Path(out_dir) / CHECKPOINTS).glob("step_*"))

    @classmethod
    def resume(cls, target: TargetAdapter, sequences: List[TrainSequence], config: TrainConfig,
               out_dir: str | Path, held_out: Optional[List[TrainSequence]] = None,
               feature_cache: Optional[str | Path] = None) -> "Trainer":
        """Continue from the newest checkpoint in ``out_dir/checkpoints``.

        Raises:
            InputError: no checkpoint to resume from; a setting of
                :data:`RUN_SETTINGS` differs from the checkpoint's (the message names
                the flags and both values); the run already reached ``config.steps``
                and its drafter in ``out_dir`` is whole. A finished run whose drafter
                is missing or differs from the final checkpoint's (a kill mid-write, a
                corrupt file) resumes with no step to train, and writes it again
                (``rebuilding`` says why).
            MismatchError: the checkpoint was trained for another target (the
                checkpoint is left as it is).
        """
        checkpoints = cls.checkpoints(out_dir)
        if not checkpoints:
            raise InputError(f"{Path(out_dir) / CHECKPOINTS}: no checkpoint to resume from")
        ckpt = checkpoints[-1]
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if state["target"] != target_fingerprint(target):
            raise MismatchError(
                f"{ckpt}: was trained for target {state['target']}, but the given target is "
                f"{target_fingerprint(target)}; pass the same --model or a new --out"
            )
        saved = state.get("config", {})
        changed = [k for k in RUN_SETTINGS if k in saved and saved[k] != getattr(config, k)]
        if changed:
            was = ", ".join(f"{RUN_SETTINGS[k]} {saved[k]}" for k in changed)
            now = ", ".join(f"{RUN_SETTINGS[k]} {getattr(config, k)}" for k in changed)
            raise InputError(
                f"{ckpt}: the run was started with {was}; resuming with {now} would not continue it "
                "(the learning-rate schedule, data order and anchors follow them): pass the same values, "
                "or train afresh into a new --out"
            )
        rebuild = None
        if state["step"] >= config.steps:
            rebuild = final_drafter_problem(Path(out_dir), ckpt)
            if rebuild is None:
                raise InputError(f"{ckpt}: the run already finished its {config.steps} steps; "
                                 f"the drafter is in {out_dir}")
        drafter = bind_drafter(load_drafter(str(ckpt)), target, str(ckpt))
        trainer = cls(drafter, target, sequences, config, out_dir, held_out, feature_cache)
        trainer.optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.npz")).items()))
        if (ckpt / AFTER_MISSES).exists():
            with np.load(ckpt / AFTER_MISSES) as saved_misses:
                trainer.after_misses = {int(i): saved_misses[i] for i in saved_misses.files}
        trainer.step = state["step"]
        trainer.rebuilding = rebuild  # run() trains no step and writes the drafter again
        return trainer
