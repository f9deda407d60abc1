"""The target's context features kept beside the data (``dflash data --target-layer-ids``): float16 ``.npy``
files named by a digest of each sequence's tokens, so any run on any split finds them; a manifest names
the target and the layers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file
from ..targets import TargetAdapter
from .data import read_json, token_digest

FOLDER = "features"  # in a data folder


def target_fingerprint(target: TargetAdapter) -> dict:
    """What must match when resuming or reusing features: family, sizes and vocabulary."""
    return {"model_type": getattr(target.model, "model_type", ""), "hidden_size": target.hidden_size,
            "num_layers": target.num_layers, "vocab_size": target.vocab_size}


class FeatureStore:
    """``folder``'s features of ``target`` at ``layer_ids``. Writing claims an empty folder (its manifest);
    reading a folder made for another target or other layers finds nothing (``mismatch`` says why)."""

    def __init__(self, folder: str | Path, target: TargetAdapter, layer_ids: List[int], write: bool = False):
        self.folder = Path(folder)
        key = {"target": target_fingerprint(target), "target_layer_ids": list(layer_ids)}
        manifest = self.folder / "manifest.json"
        self.mismatch: Optional[str] = None
        if manifest.is_file():
            if read_json(manifest, "delete the features folder (it is made again)") != key:
                self.mismatch = f"{self.folder} holds features of another target or other layers"
        elif write:
            with atomic_file(manifest, parents=True) as tmp:
                tmp.write_text(json.dumps(key, indent=2))
        else:
            self.mismatch = f"{self.folder} has no features manifest"

    def path(self, tokens: np.ndarray) -> Path:
        """The file of ``tokens``' features."""
        return self.folder / f"{token_digest([tokens])[:32]}.npy"

    def put(self, tokens: np.ndarray, features: mx.array) -> None:
        """Keep ``features`` [1, L', K*H] (L' = L or L - 1: the last token's row, which no block reads,
        may be missing and is stored as zeros) of ``tokens`` [L]; WriteError when the file cannot be written."""
        feats = np.array(features.astype(mx.float16))
        if feats.shape[1] == tokens.size - 1:
            feats = np.concatenate([feats, np.zeros_like(feats[:, :1])], axis=1)
        with atomic_file(self.path(tokens)) as tmp, open(tmp, "wb") as f:
            np.save(f, feats)

    def get(self, tokens: np.ndarray) -> Optional[np.ndarray]:
        """The kept float16 features [1, L, K*H] of ``tokens``, or None (none kept, unreadable, a mismatch)."""
        if self.mismatch is not None:
            return None
        try:
            feats = np.load(self.path(tokens))
        except (ValueError, OSError, EOFError):
            return None
        return feats if feats.ndim == 3 and feats.shape[1] == tokens.size else None
