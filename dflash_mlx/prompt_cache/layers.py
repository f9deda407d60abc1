"""One layer cache to and from plain arrays (the rows it holds) and the integers that place them."""

from typing import Any, Dict, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .drafter_context import ContextWindowCache
from .gated_delta import GatedDeltaCache
from .rollback import can_trim
from .window import WindowKVCache

Arrays = Dict[str, mx.array]
Ints = Dict[str, int]


class LayerMismatch(ValueError):
    """A stored layer does not fit the cache it is restored into (kind, window, bits or state size)."""


# kind -> (class, integers kept, of which those a restore must find equal). Exact classes only.
KINDS: Dict[str, Tuple[type, Tuple[str, ...], Tuple[str, ...]]] = {
    "KVCache": (KVCache, ("offset",), ()),
    "QuantizedKVCache": (QuantizedKVCache, ("offset", "group_size", "bits"), ("group_size", "bits")),
    "WindowKVCache": (WindowKVCache, ("offset", "start", "window"), ("window",)),
    "GatedDeltaCache": (GatedDeltaCache, ("offset",), ()),
    "ContextWindowCache": (ContextWindowCache, ("offset", "held", "sink", "window"), ("sink", "window"))}


def kind_of(c: Any) -> str:
    """The kind name of a layer cache, or "" when it cannot be stored."""
    name = type(c).__name__
    return name if name in KINDS and type(c) is KINDS[name][0] else ""


def take(c: Any) -> Tuple[Arrays, Ints]:
    """``(arrays, ints)``: the rows one layer cache holds (new array objects) and its integers (``offset``...). Raises
    LayerMismatch: a cache kind not in :data:`KINDS`."""
    kind = kind_of(c)
    if not kind:
        raise LayerMismatch(f"cannot store a {type(c).__name__} layer cache")
    if kind == "GatedDeltaCache":
        return {f"state.{i}": a for i, a in enumerate(c.cache) if a is not None}, {"offset": c.offset,
                                                                                   "slots": len(c.cache)}
    ints = {name: getattr(c, name) for name in KINDS[kind][1]}
    if c.keys is None:
        return {}, ints
    n = c.offset if kind in ("KVCache", "QuantizedKVCache") else c.held
    if kind == "QuantizedKVCache":
        parts = {name: getattr(c, name) for name in ("keys", "values")}
        return {f"{name}.{i}": a[..., :n, :] for name, arrays in parts.items() for i, a in enumerate(arrays)}, ints
    return {"keys": c.keys[..., :n, :], "values": c.values[..., :n, :]}, ints


def put(c: Any, kind: str, arrays: Arrays, ints: Ints) -> None:
    """Fill the fresh layer cache ``c`` from what :func:`take` returned for a ``kind`` cache. Raises LayerMismatch:
    ``c`` is another kind, or another window, bit width or state size; KeyError: ``arrays`` lacks rows that ``ints``
    says are held."""
    if kind_of(c) != kind:
        raise LayerMismatch(f"stored {kind} layer, this cache is a {type(c).__name__}")
    if kind == "GatedDeltaCache":
        if len(c.cache) != ints["slots"]:
            raise LayerMismatch(f"Gated-DeltaNet state of {ints['slots']} arrays, this layer's {len(c.cache)}")
        c.cache = [arrays[f"state.{i}"][...] if f"state.{i}" in arrays else None for i in range(ints["slots"])]
        c.offset, c._last = ints["offset"], None  # nothing to roll back into
        return
    _, kept, fixed = KINDS[kind]
    for name in fixed:
        if getattr(c, name) != ints[name]:
            raise LayerMismatch(f"stored {kind} with {name} {ints[name]}, this layer's {getattr(c, name)}")
    if arrays or ints["offset"]:  # new array objects: the entry stays as it was
        if kind == "QuantizedKVCache":
            n = sum(1 for k in arrays if k.startswith("keys."))
            c.keys, c.values = (tuple(arrays[f"{name}.{i}"][...] for i in range(n)) for name in ("keys", "values"))
        else:
            c.keys, c.values = arrays["keys"][...], arrays["values"][...]
    for name in kept:
        if name not in fixed:
            setattr(c, name, ints[name])


def can_go_back(kind: str, ints: Ints, rows: int) -> bool:
    """Whether a ``kind`` cache restored from ``ints`` can be trimmed to ``rows`` tokens exactly."""
    cls = KINDS[kind][0]
    c = cls.__new__(cls)
    c.__dict__.update(ints)
    c.__dict__.setdefault("keys", None)
    if cls is GatedDeltaCache:
        c._last = None
    return can_trim(c, ints["offset"] - rows)
