"""One prefix-cache entry: both caches of a pair after some tokens, and those tokens. On disk
``ID.safetensors`` (arrays) then ``ID.json`` (tokens, layers, size and sha256 of the arrays)."""

import json
from dataclasses import dataclass, field
from os.path import commonprefix
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..atomic import atomic_file
from ..fingerprint import sha256_file
from . import layers

FORMAT = 1
SIDES = ("target", "drafter")


class CorruptEntry(ValueError):
    """An entry on disk that is truncated, altered or unreadable."""


@dataclass
class Snapshot:
    """Both caches of a pair after ``tokens``: ``arrays`` named ``"target.3.keys"``-style (rows held only),
    ``layers`` per side (``"target"``, ``"drafter"``) a ``{"kind", "ints"}`` per layer."""

    tokens: List[int]
    arrays: Dict[str, mx.array]
    layers: Dict[str, List[dict]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays."""
        return sum(a.nbytes for a in self.arrays.values())


def usable_rows(tokens: Sequence[int], layer_meta: Dict[str, List[dict]], ids: Sequence[int]) -> int:
    """Rows of an entry a prompt ``ids`` resumes from: the common prefix of ``tokens`` and all but the last
    of ``ids`` where every layer trims to it exactly, else 0."""
    n = len(commonprefix([list(tokens), list(ids[:-1])]))
    if n == len(tokens):
        return n
    ok = all(layers.can_go_back(m["kind"], m["ints"], n) for side in layer_meta.values() for m in side)
    return n if ok else 0


def take_snapshot(tokens: Sequence[int], cache: List[Any], draft_cache: Optional[List[Any]]) -> Optional[Snapshot]:
    """A snapshot of both caches holding ``tokens``, or None when a layer cannot be stored or holds another count."""
    arrays: Dict[str, mx.array] = {}
    meta: Dict[str, List[dict]] = {}
    for side, caches in zip(SIDES, (cache, draft_cache)):
        if caches is None:
            continue
        meta[side] = []
        for i, c in enumerate(caches):
            if not layers.kind_of(c) or c.offset != len(tokens):
                return None
            a, ints = layers.take(c)
            arrays.update({f"{side}.{i}.{k}": v for k, v in a.items()})
            meta[side].append({"kind": layers.kind_of(c), "ints": ints})
    mx.eval(list(arrays.values()))
    return Snapshot(list(tokens), arrays, meta)


def restore(snap: Snapshot, cache: List[Any], draft_cache: Optional[List[Any]]) -> None:
    """Fill fresh caches from ``snap``. Raises layers.LayerMismatch: another number of layers, or a layer of another
    kind or window."""
    for side, caches in zip(SIDES, (cache, draft_cache)):
        stored = snap.layers.get(side)
        if caches is None and stored is None:
            continue
        if caches is None or stored is None or len(caches) != len(stored):
            raise layers.LayerMismatch(f"{side}: stored {len(stored or [])} layer caches, "
                                       f"this pair has {len(caches or [])}")
        for i, (c, m) in enumerate(zip(caches, stored)):
            prefix = f"{side}.{i}."
            mine = {k[len(prefix):]: v for k, v in snap.arrays.items() if k.startswith(prefix)}
            layers.put(c, m["kind"], mine, m["ints"])


def restore_or_warn(snap: Snapshot, cache: List[Any], draft_cache: Optional[List[Any]],
                    warn: Callable[[str], None]) -> bool:
    """:func:`restore`, or False after one warning when the entry does not fit (the caches are then unusable)."""
    try:
        restore(snap, cache, draft_cache)
    except (layers.LayerMismatch, KeyError, TypeError) as e:
        warn(f"prompt cache: an entry does not fit this pair ({e}); prefilling instead")
        return False
    return True


def write(snap: Snapshot, folder: Path, name: str) -> int:
    """Write ``snap`` as ``folder/name.safetensors`` then ``folder/name.json``; returns the bytes written. Raises
    WriteError: the folder cannot be written; nothing is left but what the store removes."""
    with atomic_file(folder / f"{name}.safetensors", parents=True) as tmp:
        mx.save_safetensors(str(tmp), snap.arrays if snap.arrays else {"empty": mx.zeros((0,))})
        size, sha = tmp.stat().st_size, sha256_file(tmp)
    text = json.dumps({"format": FORMAT, "tokens": list(snap.tokens), "layers": snap.layers, "bytes": size,
                       "sha256": sha})
    with atomic_file(folder / f"{name}.json") as tmp:
        tmp.write_text(text)
    return size + len(text)


def read_index(side_file: Path) -> dict:
    """The JSON side file of an entry, checked for form. Raises CorruptEntry: unreadable, not this format, or fields
    missing or malformed."""
    try:
        d = json.loads(side_file.read_text())
    except (OSError, ValueError) as e:
        raise CorruptEntry(f"{side_file}: unreadable ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CorruptEntry(f"{side_file}: not a prefix-cache entry of format {FORMAT}")
    if not all(k in d for k in ("tokens", "layers", "bytes", "sha256")):
        raise CorruptEntry(f"{side_file}: fields missing")
    metas = [m for side in d["layers"].values() for m in side] if isinstance(d["layers"], dict) else None
    if metas is None or not all(isinstance(m, dict) and m.get("kind") in layers.KINDS
                                and isinstance(m.get("ints"), dict) and isinstance(m["ints"].get("offset"), int)
                                for m in metas):
        raise CorruptEntry(f"{side_file}: \"layers\" malformed")
    return d


def read(folder: Path, name: str, index: Optional[dict] = None) -> Snapshot:
    """Entry ``name`` of ``folder``, its arrays checked against the recorded size and sha256. Raises CorruptEntry: a
    file is missing, truncated, altered or unreadable."""
    index = index if index is not None else read_index(folder / f"{name}.json")
    data = folder / f"{name}.safetensors"
    try:
        size = data.stat().st_size
    except OSError:
        raise CorruptEntry(f"{data}: missing") from None
    if size != index["bytes"]:
        raise CorruptEntry(f"{data}: {size} bytes, {index['bytes']} written (truncated)")
    try:
        sha = sha256_file(data)
    except OSError as e:  # removed or unreadable since the size was read
        raise CorruptEntry(f"{data}: unreadable ({e.strerror or e})") from None
    if sha != index["sha256"]:
        raise CorruptEntry(f"{data}: sha256 differs from the one written (altered)")
    try:
        arrays = mx.load(str(data))
    except Exception as e:  # mx raises RuntimeError/ValueError on a malformed file
        raise CorruptEntry(f"{data}: unreadable ({e})") from None
    arrays.pop("empty", None)
    return Snapshot(list(index["tokens"]), arrays, index["layers"])
