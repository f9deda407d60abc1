"""dflash-mlx: DFlash block-diffusion speculative decoding on MLX.

The method lives in two files: :mod:`dflash_mlx.drafter` (the drafter network)
and :mod:`dflash_mlx.generate` (the decode loop).
"""

from .checkpoint import load_drafter, save_drafter
from .drafter import DFlashDrafter
from .drafter_config import DrafterArgs
from .errors import (CheckpointError, ConfigError, DFlashError, InputError, MismatchError, RollbackError,
                     ValidationError)
from .protocol import Drafter, WrappedDrafter
from .generate import GenerationResponse, StepResult, generate, generate_step, stream_generate
from .session import ChatSession
from .loading import Pair, bind_drafter, check_pair, load, load_target
from .stats import GenerationStats
from .targets import TargetAdapter, make_adapter

__version__ = "0.1.0"

__all__ = [
    "ChatSession", "CheckpointError", "ConfigError", "DFlashDrafter", "DFlashError", "DrafterArgs",
    "Drafter", "GenerationResponse", "GenerationStats", "InputError", "MismatchError", "Pair", "RollbackError",
    "StepResult", "TargetAdapter", "ValidationError", "bind_drafter", "check_pair", "generate",
    "generate_step", "load", "load_drafter", "load_target", "make_adapter",
    "save_drafter", "stream_generate", "WrappedDrafter",
]
