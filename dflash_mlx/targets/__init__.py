"""Target adapters, one file per mlx-lm family (its adapter and ``MODEL_TYPES``), chosen by ``model_type``."""

import pkgutil
from importlib import import_module
from typing import Dict, Iterable, Type

import mlx.nn as nn
from mlx_lm.utils import MODEL_REMAPPING

from ..errors import MismatchError
from .base import TargetAdapter
from .fused import fuse_layers


def find_families(paths: Iterable[str] = __path__) -> Dict[str, Type[TargetAdapter]]:
    """``model_type`` -> adapter class, from the ``MODEL_TYPES`` dict of every module in ``paths``.

    Raises:
        RuntimeError: two adapters claim one ``model_type``.
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
    """Wrap a loaded mlx-lm model in the adapter of its ``model_type`` (after mlx-lm's
    ``MODEL_REMAPPING``), its norms and RoPE fused first (:func:`~dflash_mlx.targets.fused.fuse_layers`).

    Raises:
        MismatchError: no adapter for the ``model_type`` (names it and the supported ones).
    """
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", None)
    model_type = MODEL_REMAPPING.get(model_type, model_type)
    if model_type not in ADAPTERS:
        raise MismatchError(f"target model_type '{model_type}' is not supported yet; "
                            f"supported: {', '.join(sorted(ADAPTERS))}")
    fuse_layers(model)
    return ADAPTERS[model_type](model)
