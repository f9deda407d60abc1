"""Drafter checkpoints in the released format (DFLASH_SPEC.md section 2): a folder
or Hugging Face repo with ``config.json`` and unprefixed ``*.safetensors`` weights
(no embedding, no lm_head)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .drafter import DFlashDrafter
from .drafter_config import DrafterArgs
from .errors import CheckpointError, ConfigError
from .hub import resolve_model_path

DRAFTER_FILES = ["*.json", "*.safetensors"]


def load_drafter(path_or_repo: str, dtype: Optional[mx.Dtype] = None) -> DFlashDrafter:
    """Load a drafter from a local folder or a Hugging Face repo id.

    Args:
        path_or_repo: folder with ``config.json`` and ``*.safetensors``, or a repo id
            (downloaded into the Hugging Face cache).
        dtype: cast floating-point weights to this dtype (default: as stored).

    Returns:
        An unbound :class:`DFlashDrafter`; call ``bind`` (or use
        :func:`dflash_mlx.load`), which also checks it against the target.

    Raises:
        CheckpointError: missing folder or files, corrupt safetensors, or weights
            that do not match the config (missing, unexpected or misshapen keys).
        ConfigError: invalid or non-DFlash config.
    """
    path = resolve_model_path(path_or_repo, DRAFTER_FILES, what="drafter")
    config_file = path / "config.json"
    config = read_config(config_file)
    args = DrafterArgs.from_config(config, source=str(config_file))
    weights = read_safetensors(path)
    model = DFlashDrafter(args)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())
        raise CheckpointError(f"{path}: weights do not match config.json: {detail}") from None
    if dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the released format.

    Keys are unprefixed (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...);
    no embedding or lm_head is written. A quantized drafter's config also records
    ``quantization`` (``group_size``, ``bits``, ``mode``), which :func:`load_drafter`
    reads back; its quantized layers are the ones with ``.scales`` in the file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    floats = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    dtype = str(floats[0]).replace("mlx.core.", "")
    config = model.args.to_config(dtype=dtype)
    quantized = [m for m in model.modules() if isinstance(m, nn.QuantizedLinear)]
    if quantized:
        config["quantization"] = {"group_size": quantized[0].group_size, "bits": quantized[0].bits,
                                  "mode": quantized[0].mode}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(config_file: Path) -> dict:
    """Read a ``config.json``; errors name the file."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: not found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: invalid JSON ({e})") from None


def read_safetensors(path: Path) -> dict:
    """Load every ``*.safetensors`` file of a folder into one dict.

    Raises:
        CheckpointError: no weight file, or a file that is truncated or corrupt.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError variants
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
    return weights
