"""Target adapters, one small file per mlx-lm family, chosen by ``model_type``."""

from typing import Dict, Type

import mlx.nn as nn

from ..errors import MismatchError
from .base import TargetAdapter
from .llama import LlamaAdapter
from .qwen3 import Qwen3Adapter

ADAPTERS: Dict[str, Type[TargetAdapter]] = {
    "llama": LlamaAdapter,
    "qwen3": Qwen3Adapter,
}


def make_adapter(model: nn.Module) -> TargetAdapter:
    """Wrap a loaded mlx-lm model in the adapter of its family.

    Raises:
        MismatchError: the model's ``model_type`` has no adapter yet.
    """
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", None)
    if model_type not in ADAPTERS:
        raise MismatchError(
            f"target model_type '{model_type}' is not supported yet; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](model)


__all__ = ["ADAPTERS", "TargetAdapter", "make_adapter"]
