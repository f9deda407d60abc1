"""Target adapters, one small file per mlx-lm family, chosen by ``model_type``.

Adding a family is adding a file here (its adapter and ``MODEL_TYPES``) and its test;
docs/architecture.md shows one.
"""

import pkgutil
from importlib import import_module
from typing import Dict, Iterable, Type

import mlx.nn as nn
from mlx_lm.utils import MODEL_REMAPPING

from ..errors import MismatchError
from .base import TargetAdapter
from .fused import fuse_layers
from .hybrid import HybridAdapter


def find_families(paths: Iterable[str] = __path__) -> Dict[str, Type[TargetAdapter]]:
    """``model_type`` -> adapter class, from the ``MODEL_TYPES`` of every module in ``paths``.

    A family is one file here: its adapter and a ``MODEL_TYPES`` dict (vision-language
    wrappers map to the adapter of the text model inside, ``model.language_model``).
    """
    found: Dict[str, Type[TargetAdapter]] = {}
    for info in sorted(pkgutil.iter_modules(list(paths)), key=lambda m: m.name):
        module = import_module(f"{__name__}.{info.name}")
        for model_type, adapter in getattr(module, "MODEL_TYPES", {}).items():
            if model_type in found and found[model_type] is not adapter:
                raise RuntimeError(f"model_type {model_type!r} claimed by two adapters")
            found[model_type] = adapter
    return found


ADAPTERS: Dict[str, Type[TargetAdapter]] = find_families()


def make_adapter(model: nn.Module) -> TargetAdapter:
    """Wrap a loaded mlx-lm model in the adapter of its family.

    The family is the ``model_type`` after mlx-lm's own ``MODEL_REMAPPING`` (e.g. a
    ``mistral`` checkpoint is built as mlx-lm's ``llama`` model, so it gets the
    llama adapter). On MLX's CPU backend the model's ``nn.RMSNorm`` and ``nn.RoPE``
    become their fused, bit-identical subclasses first (:mod:`dflash_mlx.targets.fused`).

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
    fuse_layers(model)
    return ADAPTERS[model_type](model)


def __getattr__(name: str):  # each family's adapter class by name (``from dflash_mlx.targets import LlamaAdapter``)
    for adapter in ADAPTERS.values():
        if adapter.__name__ == name:
            return adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADAPTERS", "HybridAdapter", "TargetAdapter", "find_families", "make_adapter"]
