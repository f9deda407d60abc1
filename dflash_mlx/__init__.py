"""dflash-mlx: DFlash block-diffusion speculative decoding on MLX.

The method lives in two files: :mod:`dflash_mlx.drafter.network` (the drafter network) and
:mod:`dflash_mlx.decode.generate` (the decode loop). docs/architecture.md maps the rest.

The names below are imported on first use (PEP 562), so ``import dflash_mlx`` and the CLI's start-up stay light until
MLX is needed: ``dflash --help`` answers at once and Ctrl-C during the heavy imports reaches the CLI's handler.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "drafter.checkpoint": ["load_drafter", "save_drafter"],
    "drafter.network": ["DFlashDrafter"],
    "drafter.config": ["DrafterArgs"],
    "errors": ["CheckpointError", "ConfigError", "DFlashError", "InputError", "MismatchError", "RollbackError",
               "ValidationError"],
    "protocol": ["Drafter", "Proposal", "WrappedDrafter"],
    "sampling": ["Sampling"],
    "decode.generate": ["GenerationResponse", "StepResult", "generate", "generate_step", "stream_generate"],
    "chat.session": ["ChatSession"],
    "pair.loading": ["Pair", "bind_drafter", "check_pair", "load", "load_target"],
    "stats": ["GenerationStats"],
    "targets": ["TargetAdapter", "make_adapter"]}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and editors
    from .drafter.checkpoint import load_drafter, save_drafter
    from .drafter.network import DFlashDrafter
    from .drafter.config import DrafterArgs
    from .errors import (
        CheckpointError, ConfigError, DFlashError, InputError, MismatchError, RollbackError, ValidationError)
    from .protocol import Drafter, Proposal, WrappedDrafter
    from .sampling import Sampling
    from .decode.generate import GenerationResponse, StepResult, generate, generate_step, stream_generate
    from .pair.loading import Pair, bind_drafter, check_pair, load, load_target
    from .chat.session import ChatSession
    from .stats import GenerationStats
    from .targets import TargetAdapter, make_adapter
