"""A pair's identity, which a prefix-cache entry must match: weights, captured layers, dtypes, quantization,
draft window and library versions."""

import hashlib
import json
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

KEY_FORMAT = 1


def _identity(model: Any) -> str:
    """The model's folder fingerprint, else sha256 (32 hex digits) of its parameter names, dtypes, shapes and bytes."""
    if fingerprint := getattr(model, "fingerprint", None):
        return str(fingerprint)
    digest = hashlib.sha256()
    for name, p in tree_flatten(getattr(model, "model", model).parameters()):  # an adapter wraps the mlx-lm model
        digest.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        digest.update(np.asarray(p.view(mx.uint8) if p.dtype == mx.bfloat16 else p).tobytes())
    return "weights:" + digest.hexdigest()[:32]


def _quantization(module: Any) -> list:
    """Distinct ``(bits, group_size, mode)`` of the quantized layers, sorted."""
    found = {(m.bits, m.group_size, getattr(m, "mode", "affine"))
             for _, m in module.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")}
    return sorted(found)


def _dtypes(module: Any) -> list:
    return sorted({str(p.dtype) for _, p in tree_flatten(module.parameters())})


def pair_key(target: Any, drafter: Optional[Any]) -> dict:
    """The JSON-able identity of a target (adapter) and its bound drafter (None: plain decoding)."""
    import mlx_lm

    model = getattr(target, "model", target)
    key = {
        "format": KEY_FORMAT, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "target": _identity(target),
        "target_type": type(target).__name__, "target_dtypes": _dtypes(model),
        "target_quantization": _quantization(model), "drafter": None}
    if drafter is not None:
        key.update({
            "drafter": _identity(drafter), "drafter_type": type(drafter).__name__,
            "capture_layers": list(drafter.target_layer_ids),
            "drafter_dtypes": _dtypes(drafter) if hasattr(drafter, "parameters") else [],
            "drafter_quantization": _quantization(drafter) if hasattr(drafter, "named_modules") else [],
            "draft_window": list(getattr(drafter, "draft_window", None) or [])})
    return key


def key_id(key: Any) -> str:
    """24 hex digits of the sha256 of ``key``'s sorted JSON: a pair's folder, an entry's name (its tokens)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
