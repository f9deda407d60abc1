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


class FeatureStore:
    """``folder``'s features of ``target`` at ``layer_ids`` (and, as ``kind`` "hidden", its final hidden states),
    one file per token sequence, whatever data it came from. Writing claims an empty folder (its manifest);
    reading a folder made for another target or other layers finds nothing (``mismatch`` says why).
    ``unreadable``: files found unreadable by :meth:`get` (written again by the next :meth:`put`)."""

    def __init__(self, folder: str | Path, target: TargetAdapter, layer_ids: List[int], write: bool = False):
        self.folder, self.unreadable = Path(folder), []
        key, manifest = {"target": target_fingerprint(target), "target_layer_ids": list(layer_ids)}, None
        if (self.folder / "manifest.json").is_file():  # the manifest claims the folder
            manifest = read_json(self.folder / "manifest.json", "delete the features folder (it is made again)")
        elif write:
            write_json(self.folder / "manifest.json", key, indent=2, parents=True)
            manifest = key
        matches = None if manifest is None else manifest == key
        self.mismatch: Optional[str] = None if matches else (
            f"{self.folder} has no features manifest" if matches is None
            else f"{self.folder} holds features of another target or other layers")

    def path(self, tokens: np.ndarray, kind: str = "") -> Path:
        """The file of ``tokens``' features (``kind``: of its other rows, e.g. ``hidden``)."""
        return self.folder / f"{token_digest([tokens])[:32]}{'.' + kind if kind else ''}.npy"

    def put(self, tokens: np.ndarray, features: mx.array, kind: str = "") -> None:
        """Keep ``features`` [1, L', F] (L' = L or L - 1: the last token's row, which no block reads,
        may be missing and is stored as zeros) of ``tokens`` [L]; WriteError when the file cannot be written."""
        feats = np.array(features.astype(mx.float16))
        if feats.shape[1] == tokens.size - 1:
            feats = np.concatenate([feats, np.zeros_like(feats[:, :1])], axis=1)
        with atomic_file(self.path(tokens, kind)) as tmp, open(tmp, "wb") as f:  # whole or not at all: WriteError
            np.save(f, feats)

    def get(self, tokens: np.ndarray, kind: str = "") -> Optional[np.ndarray]:
        """The kept float16 rows [1, L, F] of ``tokens``, or None (none kept, unreadable, a mismatch)."""
        path = self.path(tokens, kind)
        if self.mismatch is not None or not path.is_file():
            return None
        try:
            rows = np.load(path)
        except (ValueError, OSError, EOFError):
            self.unreadable.append(path)
            return None
        return rows if rows.ndim == 3 and rows.shape[1] == tokens.size else None
