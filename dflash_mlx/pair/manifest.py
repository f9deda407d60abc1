"""``dflash.json``, the manifest of a ``dflash convert`` folder: where ``target/`` and ``drafter/`` came
from, the drafter's format and ids, their quantization, and the sha256 of every file the loaders read
(version 2; version 1 lists the weight files only)."""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..atomic import write_json
from ..errors import CheckpointError, ConfigError, InputError
from ..fingerprint import sha256_file

MANIFEST = "dflash.json"
MANIFEST_VERSION = 2  # 1: weight files only; 2: every file of target/ and drafter/
WEIGHT_GLOB = "*.safetensors"


def dtype_name(dtype) -> str:
    """An MLX dtype's name as manifests and summaries write it: ``mx.bfloat16`` -> "bfloat16"."""
    return str(dtype).replace("mlx.core.", "")


def loaded_files(root: Path, weights_only: bool = False) -> Dict[str, Path]:
    """``{relative path: path}`` of every file of ``target/`` and ``drafter/`` but hidden ones (only the
    ``*.safetensors`` with ``weights_only``)."""
    return {f"{part}/{f.name}": f for part in ("target", "drafter") for f in sorted((root / part).iterdir())
            if f.is_file() and not f.name.startswith(".") and (not weights_only or f.match(WEIGHT_GLOB))}


def hash_files(root: Path) -> Dict[str, str]:
    """``{relative path: sha256}`` of every file of :func:`loaded_files`."""
    return {name: sha256_file(path) for name, path in loaded_files(root).items()}


def write_manifest(root: Path, manifest: dict) -> Path:
    """Write ``root/dflash.json`` (keys in the given order, 2-space indent)."""
    path = root / MANIFEST
    write_json(path, manifest, indent=2)
    return path


def read_manifest(root: Path) -> dict:
    """Read and check ``root/dflash.json``. Raises ConfigError: invalid JSON, or a missing
    ``target``/``drafter``/``files`` entry (names file and key)."""
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    for key in ("target", "drafter", "files"):
        if not isinstance(manifest.get(key), dict):
            raise ConfigError(f"{path}: missing key '{key}'")
    for key in ("target", "drafter"):
        if not isinstance(manifest[key].get("path"), str):
            raise ConfigError(f"{path}: missing key '{key}.path'")
    return manifest


def verify(root: Path, manifest: Optional[dict] = None) -> None:
    """Check every listed file against the sha256 in the manifest. Raises CheckpointError: a listed file is missing or
    changed, or a file is not listed (version 1: a weight file); the message names the file."""
    manifest = manifest or read_manifest(root)
    listed = manifest["files"]
    version = manifest.get("dflash_convert", 1)
    every = isinstance(version, int) and version >= 2
    present = loaded_files(root, weights_only=not every)
    for name, want in listed.items():
        path = root / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {MANIFEST} but missing")
        if sha256_file(path) != want:
            raise CheckpointError(f"{path}: sha256 differs from {root / MANIFEST} (changed since it was converted)")
    for name in present:
        if name not in listed:
            what = "file" if every else "weight file"
            raise CheckpointError(f"{root / name}: {what} not listed in {root / MANIFEST}")


def resolve_pair(model: str, draft_model: Optional[str], verify_hashes: bool = False) -> Tuple[str, Optional[str]]:
    """``(model, draft_model)`` with a converted folder ``model`` expanded into ``DIR/target`` and, unless
    ``draft_model`` is given, ``DIR/drafter`` (hashes checked first with ``verify_hashes``).

    Raises:
        InputError: ``verify_hashes`` for a model that is not a converted folder.
        ConfigError, CheckpointError: see :func:`read_manifest` and :func:`verify`.
    """
    root = Path(model).expanduser()
    if not (root / MANIFEST).is_file():  # not a converted folder
        if verify_hashes:
            raise InputError(f"--verify: {model} is not a folder written by dflash convert (no {MANIFEST})")
        return model, draft_model
    manifest = read_manifest(root)
    if verify_hashes:
        verify(root, manifest)
    target = str(root / manifest["target"]["path"])
    return target, draft_model or str(root / manifest["drafter"]["path"])
