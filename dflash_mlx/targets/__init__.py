"""Target adapters, one small file per mlx-lm family, chosen by ``model_type``."""

from typing import Dict, Type

import mlx.nn as nn
from mlx_lm.utils import MODEL_REMAPPING

from ..errors import MismatchError
from .base import TargetAdapter
from .gemma3_text import Gemma3TextAdapter
from .gemma4_text import Gemma4TextAdapter
from .gpt_oss import GptOssAdapter
from .hybrid import HybridAdapter
from .llama import LlamaAdapter
from .qwen3 import Qwen3Adapter
from .qwen3_5 import Qwen35Adapter
from .qwen3_5_moe import Qwen35MoeAdapter
from .qwen3_moe import Qwen3MoeAdapter
from .qwen3_next import Qwen3NextAdapter

ADAPTERS: Dict[str, Type[TargetAdapter]] = {
    "gemma3_text": Gemma3TextAdapter,
    "gemma4_text": Gemma4TextAdapter,
    "gpt_oss": GptOssAdapter,
    "llama": LlamaAdapter,
    "qwen3": Qwen3Adapter,
    "qwen3_5": Qwen35Adapter,
    "qwen3_5_moe": Qwen35MoeAdapter,
    "qwen3_moe": Qwen3MoeAdapter,
    "qwen3_next": Qwen3NextAdapter,
    # Vision-language wrappers: the adapter runs the text model inside
    # (``model.language_model``), of the family named here.
    "gemma3": Gemma3TextAdapter,
    "gemma4": Gemma4TextAdapter,
    "qwen3_vl": Qwen3Adapter,
    "qwen3_vl_moe": Qwen3MoeAdapter,
}


def make_adapter(model: nn.Module) -> TargetAdapter:
    """Wrap a loaded mlx-lm model in the adapter of its family.

    The family is the ``model_type`` after mlx-lm's own ``MODEL_REMAPPING`` (e.g. a
    ``mistral`` checkpoint is built as mlx-lm's ``llama`` model, so it gets the
    llama adapter).

    Raises:
        MismatchError: the model's ``model_type`` has no adapter (one line naming
            it and the supported ones).
    """
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", None)
    model_type = MODEL_REMAPPING.get(model_type, model_type)
    if model_type not in ADAPTERS:
        raise MismatchError(
            f"target model_type '{model_type}' is not supported yet; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](model)


__all__ = ["ADAPTERS", "HybridAdapter", "TargetAdapter", "make_adapter"]
