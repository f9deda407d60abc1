"""Train a DFlash drafter against a frozen target (spec section 6): only ``fc``, ``hidden_norm``, the layers and
``norm`` learn. Options beyond the paper: distillation (``kl_weight``), several block sizes in one run, anchors after
the drafter's misses. Data order and anchors come from generators seeded by ``(seed, epoch)`` and ``(seed, step,
micro)``, and the optimizer state is checkpointed: a resumed run reproduces an uninterrupted one. Under ``mlx.launch``
the ranks share each step's micro-steps (data parallel): the same run as one process's, up to float summation order."""

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..atomic import atomic_file, signals_held, staging, write_json
from ..drafter.checkpoint import load_drafter, save_drafter
from ..drafter.network import DFlashDrafter
from ..drafter.vocab import set_draft_vocab
from ..errors import InputError, MismatchError
from ..owned import MARKER, mark, marked
from ..pair.loading import bind_drafter
from ..pair.manifest import sha256_file
from ..pair.sharded import rank, ranks
from ..ranges import check_number
from ..targets import TargetAdapter
from .blocks import default_gamma, next_anchors, position_weights, sample_anchors, valid_anchors
from .data import TrainSequence, frequent_tokens
from .evaluate import evaluate_block_sizes
from .health import EVERY as HEALTH_EVERY, Health, measure
from .features import FeatureStore, target_fingerprint
from .loss import FeatureCache, LossVocab, block_loss, block_targets, sequence_loss_and_grad

CHECKPOINTS = "checkpoints"
# full: the softmax over the whole vocabulary; data: over the training data's tokens and others drawn
# each step (LossVocab).
LOSS_VOCABS = ("full", "data", "step")
WRITER = "train"  # the mark of a training run's --out (dflash_mlx.owned)
AFTER_MISSES = "after_misses.npz"  # a checkpoint's anchors after misses (--miss-anchors)
FEATURES = "features"
# Settings that shape a run, with their flags: a resumed run must use the checkpoint's values.
RUN_SETTINGS = {"steps": "--steps", "grad_accum": "--grad-accum", "anchors": "--anchors", "lr": "--lr",
                "warmup": "--warmup", "min_lr": "min_lr", "weight_decay": "weight_decay",
                "grad_clip": "--grad-clip", "gamma": "--gamma", "dtype": "--dtype", "seed": "--seed",
                "block_sizes": "--block-sizes", "kl_weight": "--kl-weight", "kl_temperature": "--kl-temperature",
                "miss_anchors": "--miss-anchors", "loss_vocab": "--loss-vocab", "l1_weight": "--l1-weight"}


@dataclass
class TrainConfig:
    """Training settings (the paper's defaults where it gives them; flags in :data:`RUN_SETTINGS`).
    ``anchor_chunk``: blocks per forward (0: all); ``gamma``: one value, one per ``block_sizes`` entry or
    None (the spec's); ``miss_anchors``: fraction of anchors drawn right after the drafter's misses."""

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
    loss_vocab: str = "full"
    l1_weight: float = 0.0
    eval_every: int = 0
    eval_sequences: int = 16
    save_every: int = 0
    keep_checkpoints: int = 3
    init: Optional[str] = None  # the drafter the run started from (--init), None: fresh weights
    draft_vocab: int = 0  # --draft-vocab: the final drafter's draft vocabulary (0: the whole)

    def check(self) -> None:
        """InputError naming the flag of the first setting out of range (NaN and infinities included)."""
        flag = {**RUN_SETTINGS, "anchor_chunk": "--anchor-chunk", "eval_every": "--eval-every",
                "save_every": "--save-every", "eval_sequences": "--held-out", "draft_vocab": "--draft-vocab",
                "keep_checkpoints": "keep_checkpoints"}
        for name in ("steps", "grad_accum", "anchors", "keep_checkpoints"):
            check_number(flag[name], getattr(self, name), at_least=1)
        for name in ("anchor_chunk", "eval_every", "save_every", "eval_sequences", "min_lr", "weight_decay",
                     "kl_weight", "l1_weight", "draft_vocab"):
            check_number(flag[name], getattr(self, name), at_least=0)
        for name in ("lr", "grad_clip", "kl_temperature"):
            check_number(flag[name], getattr(self, name), above=0)
        check_number("--warmup", self.warmup, at_least=0, at_most=1, rule="a fraction from 0 to 1")
        check_number("--miss-anchors", self.miss_anchors, at_least=0, at_most=1, rule="a fraction from 0 to 1")
        check_number("--seed", self.seed, at_least=0, at_most=2**64 - 1)
        for g in self.gamma if isinstance(self.gamma, (list, tuple)) else [self.gamma]:
            check_number("--gamma", g, above=0)
        for b in self.block_sizes or ():
            check_number("--block-sizes", b, at_least=2)
        if self.loss_vocab not in LOSS_VOCABS:
            raise InputError(f"--loss-vocab must be one of {', '.join(LOSS_VOCABS)}, got {self.loss_vocab!r}")
        if self.loss_vocab != "full" and (self.kl_weight or self.l1_weight):
            raise InputError(f"--loss-vocab {self.loss_vocab} and --{'kl' if self.kl_weight else 'l1'}-weight: "
                             "a loss against the target's distribution needs the full vocabulary")


@dataclass
class StepInfo:
    """One optimizer step: its loss, rate, trained block tokens per second; on evaluation steps,
    :func:`~dflash_mlx.train.evaluate.evaluate_block_sizes` (largest block size first); on the first, the
    last and every :data:`~dflash_mlx.train.health.EVERY`-th step, the drafter's :class:`Health`."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    eval: Optional[Dict[int, dict]] = None
    health: Optional[Health] = None


def final_drafter_problem(out: Path, ckpt: Path) -> Optional[str]:
    """Why the drafter files in ``out`` differ from the final checkpoint ``ckpt``'s, or None."""
    for name in ("config.json", "model.safetensors"):
        if not (out / name).is_file():
            return f"{out / name} is missing"
        if sha256_file(out / name) != sha256_file(ckpt / name):
            return f"{out / name} differs from {ckpt / name} (corrupt or half written)"
    return None


def block_size_plan(config: TrainConfig, trained: int) -> Dict[int, float]:
    """``{block size: gamma}`` a run trains (default: the drafter's ``trained`` size); InputError for a
    size outside ``2..trained`` or given twice, or a gamma list of another length."""
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
    """Before a fresh run: ``out_dir`` must hold no earlier run; with ``overwrite`` a run's files are
    deleted when a training run marked the folder (:mod:`dflash_mlx.owned`). Else InputError."""
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
    return optim.join_schedules([optim.linear_schedule(0.0, config.lr, warm),
                                 optim.cosine_decay(config.lr, max(1, config.steps - warm), config.min_lr)], [warm])


class Trainer:
    """The optimisation of a drafter bound to ``target`` on ``sequences`` (``held_out``: evaluation data);
    the drafter is written to ``out_dir``, checkpoints under ``checkpoints/``. ``feature_stores``: folders
    of features ``dflash data`` kept (:class:`~dflash_mlx.train.features.FeatureStore`), read first."""

    def __init__(self, drafter: DFlashDrafter, target: TargetAdapter, sequences: List[TrainSequence],
                 config: TrainConfig, out_dir: str | Path, held_out: Optional[List[TrainSequence]] = None,
                 feature_cache: Optional[str | Path] = None, feature_stores: Sequence[Path] = ()):
        config.check()
        if ranks() > 1 and (config.grad_accum < ranks() or config.miss_anchors):
            why = (f"--grad-accum {config.grad_accum}: give at least {ranks()}" if config.grad_accum < ranks()
                   else f"--miss-anchors {config.miss_anchors:g}: give 0 (a rank sees only its own misses)")
            raise InputError(f"{why}; the {ranks()} ranks of mlx.launch share each step's sequences")
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
        for name in ("embed_tokens", "lm_head"):  # DSpark's copies bind kept (they differ from the target's)
            if name in drafter:
                drafter[name].freeze()
        self.weights = {b: mx.array(position_weights(b, gamma)) for b, gamma in self.plan.items()}
        self.optimizer = optim.AdamW(learning_rate=learning_rate(config), weight_decay=config.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        stores = [FeatureStore(f, target, drafter.target_layer_ids) for f in feature_stores]
        confidence = drafter.args.enable_confidence_head  # trained against the target's distribution too
        if confidence and config.loss_vocab != "full":
            raise InputError(f"--loss-vocab {config.loss_vocab}: a confidence head needs the full vocabulary")
        self.features = FeatureCache(target, drafter.target_layer_ids, feature_cache, stores=stores,
                                     hidden=config.kl_weight > 0 or config.l1_weight > 0 or confidence)
        self.vocab = LossVocab(target, usable, self.dtype, config.loss_vocab) if config.loss_vocab != "full" else None
        self.step = 0
        self.after_misses: Dict[int, np.ndarray] = {}  # sequence index -> next_anchors of its last visit
        self._loss_and_grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, features, blocks, targets, anchors, mask, num_blocks, target_logits=None):
        c = self.config
        return block_loss(self.drafter, features, blocks, targets, anchors, mask, self.weights[blocks.shape[1]],
                          num_blocks, target_logits, c.kl_weight, c.kl_temperature, with_lengths=c.miss_anchors > 0,
                          vocab=self.vocab, l1_weight=c.l1_weight)

    def _sequence(self, index: int) -> int:
        epoch, i = divmod(index, len(self.sequences))
        return int(np.random.default_rng([self.config.seed, epoch]).permutation(len(self.sequences))[i])

    def block_size_at(self, step: int, micro: int) -> int:
        """The block size sequence ``micro`` of ``step`` trains at (from a generator of its own)."""
        sizes = list(self.plan)  # one size: always sizes[0]
        return sizes[int(np.random.default_rng([self.config.seed, step, micro, 1]).integers(len(sizes)))]

    def _micro_step(self, step: int, micro: int):
        c = self.config
        B = self.block_size_at(step, micro)
        index = self._sequence(step * c.grad_accum + micro)
        seq = self.sequences[index]
        rng = np.random.default_rng([c.seed, step, micro])
        anchors = sample_anchors(rng, seq.tokens.size, seq.response_start, B, c.anchors,
                                 self.after_misses.get(index), c.miss_anchors)
        feats, hidden = self.features.get(seq, self.dtype)
        if self.vocab is not None:
            step_targets = block_targets(seq, anchors, B) if c.loss_vocab == "step" else None
            self.vocab.draw(np.random.default_rng([c.seed, step, micro, 2]), step_targets)
        lengths = []
        loss, grads = sequence_loss_and_grad(self._loss_and_grad, feats, seq, anchors, B,
                                             self.drafter.args.mask_token_id, c.anchor_chunk, hidden, self.target,
                                             lengths)
        if lengths:
            self.after_misses[index] = next_anchors(anchors, np.concatenate([np.array(x) for x in lengths]),
                                                    seq.tokens.size)
        return loss, grads, anchors.size * (B - 1)

    def run(self) -> Iterator[StepInfo]:
        """Train from ``self.step`` to ``config.steps``, yielding a :class:`StepInfo` after every step;
        WriteError when a checkpoint or the drafter cannot be written (earlier checkpoints stay whole)."""
        c, first = self.config, rank() == 0  # rank 0 alone writes, measures and evaluates
        if first and not marked(self.out, WRITER):
            mark(self.out, WRITER)  # so that --overwrite may later delete what this run writes
        while self.step < c.steps:
            tic = time.perf_counter()
            total, grads_sum, tokens = 0.0, None, 0
            for micro in range(rank(), c.grad_accum, ranks()):
                loss, grads, n = self._micro_step(self.step, micro)
                grads_sum = grads if grads_sum is None else tree_map(mx.add, grads_sum, grads)
                total, tokens = total + loss, tokens + n
                mx.eval(grads_sum, total)  # else every micro-step's graph stays alive until the update
            if ranks() > 1:
                grads_sum, total, tokens = tree_map(lambda x: mx.distributed.all_sum(x, stream=mx.cpu),
                                                    (grads_sum, total, mx.array(tokens)))
            grads = tree_map(lambda g: g / c.grad_accum, grads_sum)
            grads, _ = optim.clip_grad_norm(grads, c.grad_clip)
            lr = self.optimizer.learning_rate.item()
            self.optimizer.update(self.drafter, grads)
            mx.eval(self.drafter.parameters(), self.optimizer.state, total)
            self.step += 1
            info = StepInfo(self.step, float(total) / c.grad_accum, lr, int(tokens) / (time.perf_counter() - tic))
            if first and (self.step in (1, c.steps) or self.step % HEALTH_EVERY == 0):
                seq = self.sequences[0]
                info.health = measure(self.drafter, self.features.get(seq, self.dtype)[0], seq, max(self.plan))
            if first and c.eval_every and self.held_out and self.step % c.eval_every == 0:
                info.eval = evaluate_block_sizes(self.drafter, self.target, self.held_out[: c.eval_sequences],
                                                 sorted(self.plan, reverse=True), seed=c.seed,
                                                 anchor_chunk=c.anchor_chunk, chained=self.step == c.steps)
            if first and c.save_every and self.step % c.save_every == 0:
                self.save_checkpoint()
            yield info
        if c.draft_vocab:  # FR-Spec: drafts only among the data's most frequent response tokens
            set_draft_vocab(self.drafter, frequent_tokens(self.sequences, c.draft_vocab, self.target.vocab_size))
        if first:
            save_drafter(self.drafter, self.out)

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNNN/`` atomically and keep the newest few; WriteError leaves the
        earlier checkpoints and the state as they were."""
        root = self.out / CHECKPOINTS
        final = root / f"step_{self.step:07d}"
        state = {"step": self.step, "config": asdict(self.config), "target": target_fingerprint(self.target)}
        with staging(final, force=True) as tmp:
            save_drafter(self.drafter, tmp)
            with atomic_file(tmp / "optimizer.npz") as f, signals_held():  # savez runs zipfile from C++
                mx.savez(str(f), **dict(tree_flatten(self.optimizer.state)))
            if self.after_misses:  # so a resumed run draws the same anchors
                with atomic_file(tmp / AFTER_MISSES) as f:
                    np.savez(f, **{str(i): a for i, a in self.after_misses.items()})
            write_json(tmp / "trainer_state.json", state, indent=2)
        for old in sorted(root.glob("step_*"))[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    rebuilding: Optional[str] = None  # set by resume(): why the finished run's drafter is written again

    @staticmethod
    def checkpoints(out_dir: str | Path) -> List[Path]:
        """The checkpoints in ``out_dir/checkpoints``, oldest first."""
        return sorted((Path(out_dir) / CHECKPOINTS).glob("step_*"))

    @classmethod
    def resume(cls, target: TargetAdapter, sequences: List[TrainSequence], config: TrainConfig,
               out_dir: str | Path, held_out: Optional[List[TrainSequence]] = None,
               feature_cache: Optional[str | Path] = None, feature_stores: Sequence[Path] = ()) -> "Trainer":
        """Continue from the newest checkpoint. A finished run whose drafter files differ from the final
        checkpoint's resumes with no step to train and writes them again (``rebuilding`` says why).

        Raises:
            InputError: no checkpoint; a :data:`RUN_SETTINGS` value differs (names the flags and both
                values); the run finished and its drafter is whole.
            MismatchError: the checkpoint was trained for another target.
        """
        checkpoints = cls.checkpoints(out_dir)
        if not checkpoints:
            raise InputError(f"{Path(out_dir) / CHECKPOINTS}: no checkpoint to resume from")
        ckpt = checkpoints[-1]
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if state["target"] != target_fingerprint(target):
            raise MismatchError(f"{ckpt}: was trained for target {state['target']}, but the given target is "
                                f"{target_fingerprint(target)}; pass the same --model or a new --out")
        saved = state.get("config", {})
        changed = [k for k in RUN_SETTINGS if k in saved and saved[k] != getattr(config, k)]
        if changed:
            was = ", ".join(f"{RUN_SETTINGS[k]} {saved[k]}" for k in changed)
            now = ", ".join(f"{RUN_SETTINGS[k]} {getattr(config, k)}" for k in changed)
            raise InputError(f"{ckpt}: the run was started with {was}; resuming with {now} would not continue it "
                             "(the learning-rate schedule, data order and anchors follow them): pass the same values, "
                             "or train afresh into a new --out")
        rebuild = None
        if state["step"] >= config.steps:
            rebuild = final_drafter_problem(Path(out_dir), ckpt)
            if rebuild is None:
                raise InputError(f"{ckpt}: the run already finished its {config.steps} steps; "
                                 f"the drafter is in {out_dir}")
        drafter = bind_drafter(load_drafter(str(ckpt)), target, str(ckpt))
        trainer = cls(drafter, target, sequences, config, out_dir, held_out, feature_cache, feature_stores)
        with signals_held():  # an npz is read through zipfile, from C++
            trainer.optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.npz")).items()))
        if (ckpt / AFTER_MISSES).exists():
            with np.load(ckpt / AFTER_MISSES) as saved_misses:
                trainer.after_misses = {int(i): saved_misses[i] for i in saved_misses.files}
        trainer.step = state["step"]
        trainer.rebuilding = rebuild  # run() trains no step and writes the drafter again
        return trainer
