"""The target's context features kept beside the data (``dflash data --target-layer-ids``): float16 ``.npy``
files named by a digest of each sequence's tokens, so any run on any split finds them; a manifest names
the target and the layers."""

from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file, write_json
from ..targets import TargetAdapter
from .data import read_json, token_digest

FOLDER = "features"  # in a data folder


def target_fingerprint(target: TargetAdapter) -> dict:
    """What must match when resuming or reusing features: family, sizes and vocabulary."""
    return {"model_type": getattr(target.model, "model_type", ""), "hidden_size": target.hidden_size,
            "num_layers": target.num_layers, "vocab_size": target.vocab_size}


def claim_manifest(folder: Path, key: dict, write: bool) -> Optional[bool]:
    """Whether ``folder``'s ``manifest.json`` is ``key``: True (or written, with ``write``, where there was
    none), False where it differs, None where there is none."""
    path = folder / "manifest.json"
    if path.is_file():
        return read_json(path, "delete the features folder (it is made again)") == key
    if not write:
        return None
    write_json(path, key, indent=2, parents=True)
    return True


def read_rows(path: Path, length: int, unreadable: Optional[List[Path]] = None) -> Optional[np.ndarray]:
    """The array [1, ``length``, F] saved at ``path``, or None: missing, of another length, or unreadable
    (then appended to ``unreadable``)."""
    if not path.is_file():
        return None
    try:
        array = np.load(path)
    except (ValueError, OSError, EOFError):
        if unreadable is not None:
            unreadable.append(path)
        return None
    return array if array.ndim == 3 and array.shape[1] == length else None


def write_rows(path: Path, array: np.ndarray) -> None:
    """Save ``array`` at ``path`` whole or not at all; WriteError when it cannot be written."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


class FeatureStore:
    """``folder``'s features of ``target`` at ``layer_ids``. Writing claims an empty folder (its manifest);
    reading a folder made for another target or other layers finds nothing (``mismatch`` says why)."""

    def __init__(self, folder: str | Path, target: TargetAdapter, layer_ids: List[int], write: bool = False):
        self.folder = Path(folder)
        key = {"target": target_fingerprint(target), "target_layer_ids": list(layer_ids)}
        matches = claim_manifest(self.folder, key, write)
        self.mismatch: Optional[str] = None if matches else (
            f"{self.folder} has no features manifest" if matches is None
            else f"{self.folder} holds features of another target or other layers")

    def path(self, tokens: np.ndarray) -> Path:
        """The file of ``tokens``' features."""
        return self.folder / f"{token_digest([tokens])[:32]}.npy"

    def put(self, tokens: np.ndarray, features: mx.array) -> None:
        """Keep ``features`` [1, L', K*H] (L' = L or L - 1: the last token's row, which no block reads,
        may be missing and is stored as zeros) of ``tokens`` [L]; WriteError when the file cannot be written."""
        feats = np.array(features.astype(mx.float16))
        if feats.shape[1] == tokens.size - 1:
            feats = np.concatenate([feats, np.zeros_like(feats[:, :1])], axis=1)
        write_rows(self.path(tokens), feats)

    def get(self, tokens: np.ndarray) -> Optional[np.ndarray]:
        """The kept float16 features [1, L, K*H] of ``tokens``, or None (none kept, unreadable, a mismatch)."""
        return None if self.mismatch is not None else read_rows(self.path(tokens), tokens.size)
