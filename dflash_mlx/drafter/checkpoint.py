"""Drafter checkpoints (spec sections 2, 9 and 11): a folder or Hugging Face repo with ``config.json`` and
unprefixed ``*.safetensors`` weights (no embedding, no lm_head but DSpark's copies), named as
:mod:`dflash_mlx.drafter.formats` says."""

import dataclasses
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..atomic import atomic_file, write_json
from ..fingerprint import folder_fingerprint
from .network import DFlashDrafter
from .config import DrafterArgs
from ..errors import CheckpointError, ConfigError
from ..hub import resolve_model_path

DRAFTER_FILES = ["*.json", "*.safetensors"]


def load_drafter(path_or_repo: str, dtype: Optional[mx.Dtype] = None) -> DFlashDrafter:
    """An unbound drafter of any format from a folder or repo id (``bind`` it, or use
    :func:`dflash_mlx.load`); strict: exactly the weights the config implies. ``dtype`` casts floats.
    CheckpointError: missing folder or files, corrupt safetensors, or a weight missing, unexpected or of another
    shape; ConfigError: invalid or non-DFlash config (both name the file and key)."""
    path = resolve_model_path(path_or_repo, DRAFTER_FILES, what="drafter")
    config_file = path / "config.json"
    config = read_config(config_file)
    args = DrafterArgs.from_config(config, source=str(config_file))
    stored, files = read_safetensors(path, with_files=True)
    if "mask_embedding" in stored:
        args = dataclasses.replace(args, mask_embedding=True)
    fmt = args.format
    weights = {fmt.network_key(k): v for k, v in stored.items()}
    model = DFlashDrafter(args)
    if (q := config.get("quantization")) is not None:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    check_weights(model, stored, files, path, fmt)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    model.fingerprint = folder_fingerprint(path)  # keys its prompt-cache entries
    return model


def check_weights(model: DFlashDrafter, stored: dict, files: dict, path: Path, fmt) -> None:
    """Every weight the config implies present (``stored``: checkpoint name -> array, ``files``: -> its
    file) with its shape and a float dtype where the network has one, and no other; else CheckpointError
    naming the file (the folder for a missing weight) and key."""
    expected = {fmt.checkpoint_key(k): v for k, v in tree_flatten(model.parameters())}
    what = f"a {fmt.architecture} drafter with this config.json"
    for key in sorted(expected):
        if key not in stored:
            raise CheckpointError(f"{path}: missing weight '{key}' ({what} needs it)")
    for key in sorted(stored):
        if key not in expected:
            raise CheckpointError(f"{files[key]}: unexpected weight '{key}' (not part of {what})")
    for key in sorted(expected):
        have, want = stored[key], expected[key]
        if tuple(have.shape) != tuple(want.shape):
            raise CheckpointError(f"{files[key]}: weight '{key}' has shape {list(have.shape)}, "
                                  f"but config.json implies {list(want.shape)}")
        if mx.issubdtype(want.dtype, mx.floating) and not mx.issubdtype(have.dtype, mx.floating):
            raise CheckpointError(f"{files[key]}: weight '{key}' has dtype {have.dtype}, expected a float dtype")


def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (each atomically) in the drafter's own format:
    the format's weight names, no embedding or lm_head but DSpark's copies (those
    :meth:`~dflash_mlx.drafter.network.DFlashDrafter.bind` set aside included); a quantized drafter's config
    records ``quantization`` (``group_size``, ``bits``, ``mode``)."""
    out, fmt = Path(out_dir), model.args.format
    out.mkdir(parents=True, exist_ok=True)
    copies = {name: m.parameters() for name, m in model.__dict__.get("copies", {}).items()}
    weights = {fmt.checkpoint_key(k): v for k, v in tree_flatten({**model.parameters(), **copies})}
    floats = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    config = model.args.to_config(dtype=str(floats[0]).replace("mlx.core.", ""))
    if quantized := [m for m in model.modules() if isinstance(m, nn.QuantizedLinear)]:
        config["quantization"] = {"group_size": quantized[0].group_size, "bits": quantized[0].bits,
                                  "mode": quantized[0].mode}
    with atomic_file(out / "model.safetensors") as tmp:
        write_safetensors(tmp, weights, metadata={"format": "pt"})
    write_json(out / "config.json", config, indent=2)
    return out


def write_safetensors(path: Path, arrays: dict, metadata: Optional[dict] = None) -> None:
    """Write arrays with the ``safetensors`` library (a checkpoint read and saved again is the same file
    byte for byte; ``mx.save_safetensors`` orders data by its hash map)."""
    import numpy as np
    import safetensors

    raw = {}
    for key, a in arrays.items():
        data = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # numpy has no bfloat16
        raw[key] = (str(a.dtype).rsplit(".", 1)[-1], list(a.shape), np.ascontiguousarray(data))  # float32, bool
    specs = {k: safetensors.TensorSpec(dtype=d, shape=s, data_ptr=b.ctypes.data, data_len=b.nbytes)
             for k, (d, s, b) in raw.items()}
    safetensors.serialize_file(specs, str(path), metadata=metadata)


# Values of a config's torch_dtype / dtype: the float types weights are stored in.
CONFIG_DTYPES = ("float16", "bfloat16", "float32", "float64", "auto")


def read_config(config_file: Path, missing: str = "not found") -> dict:
    """A ``config.json`` (``missing``: what a missing file's error says); errors name the file and key (ConfigError
    for invalid JSON, or a ``torch_dtype`` or ``dtype`` naming no float type, with its value)."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: {missing}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_file}: invalid JSON ({e})") from None
    for key in ("torch_dtype", "dtype") if isinstance(config, dict) else ():  # each None or a float type's name
        value = config.get(key)
        name = value[len("torch."):] if isinstance(value, str) and value.startswith("torch.") else value
        if value is not None and not (isinstance(name, str) and (name in CONFIG_DTYPES or name.startswith("float8"))):
            raise ConfigError(f"{config_file}: '{key}' must be one of {', '.join(CONFIG_DTYPES)}, got {value!r}")
    return config


def read_safetensors(path: Path, with_files: bool = False):
    """Every ``*.safetensors`` file of a folder as ``{key: array}`` (with ``with_files`` also ``{key: file}``);
    CheckpointError: no weight file, a truncated or corrupt file, or a key in two files (names both)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    weights, where = {}, {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError variants
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
        for key in loaded:
            if key in where:
                raise CheckpointError(f"{f}: weight '{key}' is also in {where[key]}")
            where[key] = f
        weights.update(loaded)
    return (weights, where) if with_files else weights
