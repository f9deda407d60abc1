"""Load a target (through mlx-lm) and a drafter, check that they fit, bind them."""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, dequantize_model, load as mlx_lm_load

from ..drafter.checkpoint import load_drafter, read_config
from ..drafter.formats import FORMATS
from ..drafter.network import DFlashDrafter
from ..errors import CheckpointError, ConfigError, InputError, MismatchError
from ..fingerprint import folder_fingerprint
from ..hub import DEFAULT_MODEL, resolve_model_path
from .manifest import dtype_name, resolve_pair
from .sharded import load_sharded, rank, ranks
from ..targets import TargetAdapter, make_adapter

TARGET_FILES = DEFAULT_ALLOW_PATTERNS  # what mlx-lm itself downloads for a model


@dataclass
class Pair:
    """A loaded target, its tokenizer and (optionally) a bound drafter."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    target: TargetAdapter
    drafter: Optional[DFlashDrafter]
    model_path: str
    draft_path: Optional[str]


def load_model(path_or_repo: str, what: str = "model", lazy: bool = False, sharding: Optional[str] = None):
    """Load any mlx-lm model and its tokenizer from a folder, a repo id, a GGUF file or an Ollama name
    (:func:`.gguf.gguf_folder`) (``lazy``: no weights read yet; ``sharding``: ``tensor`` splits it over the
    ranks of ``mx.distributed``, :mod:`.sharded`).

    Returns:
        ``(model, tokenizer, folder)``: ``folder`` is the local folder it loaded from.

    Raises:
        CheckpointError: missing or unreadable checkpoint, or a DFlash drafter (names the path and ``what``).
        ConfigError: ``config.json`` is not a JSON object with a ``model_type`` mlx-lm supports, or mlx-lm
            cannot build the model from it (names the file).
    """
    from .gguf import gguf_folder

    path = gguf_folder(path_or_repo) or resolve_model_path(path_or_repo, TARGET_FILES, what=what)
    config_file = path / "config.json"
    config = read_config(config_file, missing=f"not found (is {path} an mlx-lm model folder?)")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: expected a JSON object, found {type(config).__name__}")
    if is_drafter_config(config):
        raise CheckpointError(f"{path}: this is a DFlash drafter, not a {what}; pass it as --draft-model")
    if "model_type" not in config:
        raise ConfigError(f"{config_file}: missing key 'model_type'")
    try:
        model, tokenizer = mlx_lm_load(str(path), lazy=lazy) if sharding is None else \
            load_sharded(path, sharding, config["model_type"])
        return model, tokenizer, path
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        if isinstance(e, ValueError) and "not supported" in str(e):
            import mlx_lm

            raise ConfigError(f"{config_file}: model_type '{config.get('model_type')}' (architectures "
                              f"{config.get('architectures')}) is not supported by mlx-lm "
                              f"{mlx_lm.__version__}") from None
        raise CheckpointError(f"{path}: cannot load the {what} ({' '.join(str(e).split())})") from None
    except (TypeError, KeyError, AttributeError) as e:  # mlx-lm building ModelArgs from bad values
        raise ConfigError(f"{config_file}: cannot build the {what} from it ({type(e).__name__}: {e})") from None


def is_drafter_config(config: dict) -> bool:
    """Whether a ``config.json`` describes a DFlash drafter (its architecture or ``dflash_config``)."""
    archs = config.get("architectures") or []
    return "dflash_config" in config or any(a in FORMATS for a in archs)  # a drafter format's `architectures`


def load_target(path_or_repo: str, sharding: Optional[str] = None):
    """Load a target: :func:`load_model` plus the adapter of its family, ``(model, tokenizer, adapter)``. Raises
    CheckpointError: missing or unreadable checkpoint (names the path). MismatchError: no adapter."""
    model, tokenizer, folder = load_model(path_or_repo, what="target model", sharding=sharding)
    target = make_adapter(model)
    target.fingerprint = folder_fingerprint(folder) + (f"-{sharding}{rank()}of{ranks()}" if sharding else "")
    return model, tokenizer, target


def check_pair(drafter: DFlashDrafter, target: TargetAdapter, draft_source: str = "drafter") -> None:
    """Check that a drafter fits a target. Raises MismatchError: vocabulary size, hidden size, target layer ids or the
    number of target layers differ; the message names the config key."""
    args = drafter.args
    for key, theirs in (("vocab_size", target.vocab_size), ("hidden_size", target.hidden_size)):
        if getattr(args, key) != theirs:
            raise MismatchError(f"{draft_source}: {key} {getattr(args, key)} does not match the target's "
                                f"{theirs}; this drafter was trained for another target")
    if args.num_target_layers is not None and args.num_target_layers != target.num_layers:
        raise MismatchError(f"{draft_source}: num_target_layers {args.num_target_layers} does not match "
                            f"the target's {target.num_layers} layers")
    if max(args.target_layer_ids) >= target.num_layers:
        raise MismatchError(f"{draft_source}: dflash_config.target_layer_ids {args.target_layer_ids} "
                            f"name layers beyond the target's {target.num_layers}")


def is_quantized(module: nn.Module) -> bool:
    """True when any layer of ``module`` is an ``nn.QuantizedLinear``."""
    return any(isinstance(m, nn.QuantizedLinear) for m in module.modules())


def float_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype of a module's first floating-point parameter."""
    return next(v.dtype for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def quantization(module: nn.Module) -> str:
    """``4-bit (group 64)`` from the module's quantized layers, or ``none (float16)``; a drafter dequantized on a
    CPU (:func:`bind_drafter`): ``8-bit (group 64) file, float32 here``."""
    if stored := module.__dict__.get("file_quantization"):
        return f"{stored} file, {dtype_name(float_dtype(module))} here"
    kinds = sorted({(m.bits, m.group_size) for m in module.modules()
                    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))})
    return ", ".join(f"{b}-bit (group {g})" for b, g in kinds) if kinds else f"none ({dtype_name(float_dtype(module))})"


# A quantized drafter computes in float32, whatever the target's dtype (fp16 activations gave NaN logits
# on M1/M2; z-lab/dflash#160).
QUANTIZED_DRAFTER_DTYPE = mx.float32


def bind_drafter(drafter: DFlashDrafter, target: TargetAdapter, draft_source: str = "drafter") -> DFlashDrafter:
    """Check the pair, bind the target's embedding and head, set the drafter's activation dtype: the target's for a
    float one, :data:`QUANTIZED_DRAFTER_DTYPE` for a quantized one (cast at both ends; dequantized on a CPU). Its
    weights are evaluated here: a lazy array belongs to this thread's stream, and serve decodes in another."""
    check_pair(drafter, target, draft_source)
    embed, head = target.embed, target.head
    if is_quantized(drafter) and mx.issubdtype(target.dtype, mx.floating):
        if mx.default_device() == mx.cpu:  # MLX's quantized matmul is slow on a CPU: float32 weights there
            drafter.__dict__["file_quantization"] = quantization(drafter)  # not module state: what the file holds
            dequantize_model(drafter)
        dtype, head_dtype = QUANTIZED_DRAFTER_DTYPE, target.dtype
        drafter.set_dtype(dtype)
        embed, head = lambda ids: target.embed(ids).astype(dtype), lambda h: target.head(h.astype(head_dtype))
    elif drafter.fc.weight.dtype != target.dtype and mx.issubdtype(target.dtype, mx.floating):
        drafter.set_dtype(target.dtype)
    mx.eval(drafter.parameters())
    return drafter.bind(embed, head, target.logit_cap)


def load(model: str = DEFAULT_MODEL, draft_model: Optional[str] = None, verify: bool = False,
         draft_window: Optional[Tuple[int, int]] = None, sharding: Optional[str] = None) -> Pair:
    """Load a target and, if given, its drafter, ready for :func:`stream_generate`.

    Args:
        model, draft_model: folders or repo ids; a ``dflash convert`` folder as ``model`` gives both.
        verify: check a converted folder's files against its manifest first (:func:`.manifest.verify`).
        draft_window: ``(sink, window)`` context rows the drafter's full-attention layers keep; None: all.
        sharding: ``tensor`` splits the target over the ranks of ``mx.distributed``; None loads it whole.

    Raises:
        CheckpointError, ConfigError, MismatchError: see the loaders above.
        InputError: ``verify`` for a model that is not a converted folder; a draft window without a drafter.
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
