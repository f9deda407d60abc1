"""The frozen target's outputs that training reads: context features (spec section 3) and, for
distillation, final hidden states, computed once per sequence and kept on disk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file
from ..errors import InputError
from ..targets import TargetAdapter
from .data import TrainSequence, read_json


def target_fingerprint(target: TargetAdapter) -> dict:
    """What must match when resuming: family, sizes and vocabulary."""
    return {"model_type": getattr(target.model, "model_type", ""), "hidden_size": target.hidden_size,
            "num_layers": target.num_layers, "vocab_size": target.vocab_size}


def target_outputs(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> Tuple[mx.array, mx.array]:
    """Context features [1, L, K*H] and final hidden states [1, L, H] (the input of ``target.lm_head``) of
    a whole sequence, one frozen forward, no gradient."""
    hidden, feats = target(mx.array(tokens[None]), [None] * target.num_layers, layer_ids)
    return mx.stop_gradient(feats.astype(dtype)), mx.stop_gradient(hidden.astype(dtype))


def target_features(target: TargetAdapter, tokens: np.ndarray, layer_ids: List[int], dtype) -> mx.array:
    """[1, L, K*H] context features of a whole sequence."""
    return target_outputs(target, tokens, layer_ids, dtype)[0]


class FeatureCache:
    """Per-sequence target features (and with ``hidden`` its final hidden states, not its [L, V] logits)
    in memory and, with a ``folder``, as float16 ``NNNNNNN.npy`` / ``NNNNNNN.hidden.npy`` files.

    Raises:
        InputError: the folder's ``manifest.json`` names other ``sequences``, layer ids or target.
    """

    def __init__(self, target: TargetAdapter, layer_ids: List[int], folder: Optional[str | Path] = None,
                 hidden: bool = False, sequences: Optional[List[TrainSequence]] = None):
        self.target, self.layer_ids, self.hidden = target, list(layer_ids), hidden
        self.folder = Path(folder) if folder else None
        self.memory: Dict[int, Tuple[np.ndarray, Optional[np.ndarray]]] = {}
        self.rebuilt: List[Path] = []  # cached files found unreadable and computed again
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_manifest(sequences)

    def _check_manifest(self, sequences: Optional[List[TrainSequence]]) -> None:
        digest = hashlib.sha256()
        for seq in sequences or []:
            digest.update(seq.tokens.astype(np.int32).tobytes() + b"|")
        key = {"target": target_fingerprint(self.target), "target_layer_ids": self.layer_ids,
               "sequences": digest.hexdigest() if sequences is not None else None}
        path = self.folder / "manifest.json"
        if path.is_file():
            if read_json(path, "delete the features folder (it is made again)") != key:
                raise InputError(f"{self.folder}: holds target features of other data, target_layer_ids or target; "
                                 "give another features folder")
        else:
            with atomic_file(path) as tmp:
                tmp.write_text(json.dumps(key, indent=2))

    def _load(self, path: Path, length: int) -> Optional[np.ndarray]:
        """The cached array, or None when missing, of another length or unreadable (then recorded in ``rebuilt``)."""
        if not path.is_file():
            return None
        try:
            cached = np.load(path)
        except (ValueError, OSError, EOFError):
            self.rebuilt.append(path)
            return None
        return cached if cached.ndim == 3 and cached.shape[1] == length else None

    @staticmethod
    def _save(path: Path, array: np.ndarray) -> None:
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            np.save(f, array)

    def get(self, index: int, seq: TrainSequence, dtype) -> Tuple[mx.array, Optional[mx.array]]:
        """Features [1, L, K*H] of sequence ``index`` and its final hidden states [1, L, H] (None without ``hidden``)."""
        if self.folder is None:
            feats, hidden = target_outputs(self.target, seq.tokens, self.layer_ids, dtype)
            return feats, hidden if self.hidden else None
        if index not in self.memory:
            path = self.folder / f"{index:07d}.npy"
            feats = self._load(path, seq.tokens.size)
            hidden = self._load(path.with_suffix(".hidden.npy"), seq.tokens.size) if self.hidden else None
            if feats is None or (self.hidden and hidden is None):
                f, h = target_outputs(self.target, seq.tokens, self.layer_ids, mx.float32)
                feats, hidden = np.array(f.astype(mx.float16)), np.array(h.astype(mx.float16))
                self._save(path, feats)
                if self.hidden:
                    self._save(path.with_suffix(".hidden.npy"), hidden)
            self.memory[index] = (feats, hidden if self.hidden else None)
        feats, hidden = self.memory[index]
        return mx.array(feats).astype(dtype), None if hidden is None else mx.array(hidden).astype(dtype)
