"""Load a target (through mlx-lm) and a drafter, check that they fit, bind them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
from mlx_lm.utils import load as mlx_lm_load

from ..drafter.checkpoint import load_drafter, read_config
from ..drafter.network import DFlashDrafter
from ..errors import CheckpointError, ConfigError, InputError, MismatchError
from ..fingerprint import folder_fingerprint
from ..hub import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, resolve_model_path
from .manifest import resolve_pair
from .sharded import load_sharded, rank, ranks
from ..targets import TargetAdapter, make_adapter

TARGET_FILES = DEFAULT_ALLOW_PATTERNS  # what mlx-lm itself downloads for a model
# `architectures` of DFlash drafter checkpoints (DFLASH_SPEC.md section 2): v1, DFlash2, Muse-Glimmer.
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "MuseGlimmerAssistantModel")


@dataclass
class Pair:
    """A loaded target, its tokenizer and (optionally) a bound drafter."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    target: TargetAdapter
    drafter: Optional[DFlashDrafter]
    model_path: str
    draft_path: Optional[str]


def load_model(path_or_repo: str, what: str = "model"):
    """Load any mlx-lm model and its tokenizer from a folder or repo id.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        See :func:`load_model_from`.
    """
    model, tokenizer, _ = load_model_from(path_or_repo, what)
    return model, tokenizer


def load_model_from(path_or_repo: str, what: str = "model", sharding: Optional[str] = None):
    """:func:`load_model`, and the local folder it loaded from; ``sharding`` (``tensor``) splits
    it over the ranks of ``mx.distributed`` (:mod:`dflash_mlx.pair.sharded`).

    Returns:
        ``(model, tokenizer, folder)``.

    Raises:
        CheckpointError: missing or unreadable checkpoint, or a DFlash drafter
            (names the path and ``what``).
        ConfigError: ``config.json`` is not a JSON object with a ``model_type``, or
            mlx-lm cannot build the model from it (names the file).
    """
    path = resolve_model_path(path_or_repo, TARGET_FILES, what=what)
    config_file = path / "config.json"
    config = read_model_config(config_file, path)
    if is_drafter_config(config):
        raise CheckpointError(f"{path}: this is a DFlash drafter, not a {what}; pass it as --draft-model")
    if "model_type" not in config:
        raise ConfigError(f"{config_file}: missing key 'model_type'")
    try:
        model, tokenizer = mlx_lm_load(str(path)) if sharding is None else \
            load_sharded(path, sharding, config["model_type"])
        return model, tokenizer, path
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot load the {what} ({e})") from None
    except (TypeError, KeyError, AttributeError) as e:  # mlx-lm building ModelArgs from bad values
        raise ConfigError(f"{config_file}: cannot build the {what} from it ({type(e).__name__}: {e})") from None


def read_model_config(config_file: Path, folder: Path) -> dict:
    """A model folder's ``config.json`` as a dict.

    Raises:
        CheckpointError: the file is missing. ConfigError: not a JSON object, or a
            ``torch_dtype`` that names no float type (names the file).
    """
    config = read_config(config_file, missing=f"not found (is {folder} an mlx-lm model folder?)")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: expected a JSON object, found {type(config).__name__}")
    return config


def is_drafter_config(config: dict) -> bool:
    """Whether a ``config.json`` describes a DFlash drafter (its architecture or ``dflash_config``)."""
    archs = config.get("architectures") or []
    return "dflash_config" in config or any(a in DRAFTER_ARCHITECTURES for a in archs)


def load_target(path_or_repo: str, sharding: Optional[str] = None):
    """Load a target: :func:`load_model` plus the adapter of its family.

    Returns:
        ``(model, tokenizer, adapter)``.

    Raises:
        CheckpointError: missing or unreadable checkpoint (names the path).
        MismatchError: the family has no adapter yet.
    """
    model, tokenizer, folder = load_model_from(path_or_repo, what="target model", sharding=sharding)
    target = make_adapter(model)
    target.fingerprint = folder_fingerprint(folder) + (f"-{sharding}{rank()}of{ranks()}" if sharding else "")  # keys its calibration (dflash_mlx.decode.calibration_store)
    return model, tokenizer, target


def check_pair(drafter: DFlashDrafter, target: TargetAdapter, draft_source: str = "drafter") -> None:
    """Check that a drafter fits a target.

    Raises:
        MismatchError: vocabulary size, hidden size, target layer ids or the
            number of target layers differ; the message names the config key.
    """
    args = drafter.args
    if args.vocab_size != target.vocab_size:
        raise MismatchError(
            f"{draft_source}: vocab_size {args.vocab_size} does not match the target's "
            f"{target.vocab_size}; this drafter was trained for another target"
        )
    if args.hidden_size != target.hidden_size:
        raise MismatchError(
            f"{draft_source}: hidden_size {args.hidden_size} does not match the target's "
            f"{target.hidden_size}; this drafter was trained for another target"
        )
    if args.num_target_layers is not None and args.num_target_layers != target.num_layers:
        raise MismatchError(
            f"{draft_source}: num_target_layers {args.num_target_layers} does not match "
            f"the target's {target.num_layers} layers"
        )
    if max(args.target_layer_ids) >= target.num_layers:
        raise MismatchError(
            f"{draft_source}: dflash_config.target_layer_ids {args.target_layer_ids} "
            f"name layers beyond the target's {target.num_layers}"
        )


def is_quantized(module: nn.Module) -> bool:
    """True when any layer of ``module`` is an ``nn.QuantizedLinear``."""
    return any(isinstance(m, nn.QuantizedLinear) for m in module.modules())


# A quantized drafter computes in float32, whatever the target's dtype. On M1/M2
# (bf16 emulated) fp16 activations made quantized DFlash2 drafters' logits NaN, 0%
# acceptance (z-lab/dflash#160, bstnxbt/dflash-mlx#60), and float32 was the fastest
# setting there. Its weights are 4/8-bit, so a B-row block in float32 costs little.
QUANTIZED_DRAFTER_DTYPE = mx.float32


def bind_drafter(drafter: DFlashDrafter, target: TargetAdapter, draft_source: str = "drafter") -> DFlashDrafter:
    """Check the pair, bind the target's embedding and head, and choose the
    drafter's activation dtype: the target's for a float drafter, float32 for a
    quantized one (:data:`QUANTIZED_DRAFTER_DTYPE`; its embeddings are cast in, its
    hidden states cast back to the target's dtype before the head)."""
    check_pair(drafter, target, draft_source)
    if is_quantized(drafter) and mx.issubdtype(target.dtype, mx.floating):
        dtype, head_dtype = QUANTIZED_DRAFTER_DTYPE, target.dtype
        drafter.set_dtype(dtype)
        return drafter.bind(lambda ids: target.embed(ids).astype(dtype),
                            lambda h: target.lm_head(h.astype(head_dtype)))
    if drafter.fc.weight.dtype != target.dtype and mx.issubdtype(target.dtype, mx.floating):
        drafter.set_dtype(target.dtype)
    return drafter.bind(target.embed, target.lm_head)


def load(model: str = DEFAULT_MODEL, draft_model: Optional[str] = None, verify: bool = False,
         draft_window: Optional[Tuple[int, int]] = None, sharding: Optional[str] = None) -> Pair:
    """Load a target and, if given, its drafter, ready for :func:`stream_generate`.

    A folder written by ``dflash convert`` (with ``dflash.json``) as ``model`` gives
    both: its ``target/`` and, unless ``draft_model`` is given, its ``drafter/``.

    Args:
        model, draft_model: folders or repo ids.
        verify: check the converted folder's weight files against the sha256 in
            its manifest first (see :func:`dflash_mlx.pair.manifest.verify`).
        draft_window: ``(sink, window)`` context rows the drafter's full-attention
            layers keep (``--draft-window``); None keeps all.
        sharding: ``tensor`` splits the target over the ranks of ``mx.distributed``; None loads it whole.

    Raises:
        CheckpointError, ConfigError, MismatchError: see the loaders above.
        InputError: ``verify`` for a model that is not a converted folder; a draft
            window without a drafter or out of range.
    """
    model, draft_model = resolve_pair(model, draft_model, verify)
    if draft_window is not None and draft_model is None:
        raise InputError("--draft-window needs --draft-model (it bounds the drafter's context)")
    net, tokenizer, target = load_target(model, sharding)
    drafter = None
    if draft_model is not None:
        drafter = bind_drafter(load_drafter(draft_model), target, draft_model)
        drafter.set_draft_window(draft_window)
    return Pair(net, tokenizer, target, drafter, model, draft_model)
