"""One layer cache to and from plain arrays and integers, for every cache kind a pair uses.

mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` cannot serve here: loading builds
each cache from its class name looked up among mlx-lm's own classes, so our caches
(:class:`~dflash_mlx.prompt_cache.trim.WindowKVCache`, ``GatedDeltaCache``,
``ContextWindowCache``) cannot come back; and its ``KVCache.state`` is the whole
preallocated buffer, not the rows held. So each kind is taken apart here: only the rows
it holds, and the integers that place them. A restore fills a fresh cache of the same
kind (made by the target or drafter, so a Gated-DeltaNet cache keeps its owner layer and
every cache its rollback slack) and refuses one of another kind or shape.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .drafter_context import ContextWindowCache
from .gated_delta import GatedDeltaCache
from .trim import can_trim
from .window import WindowKVCache

Arrays = Dict[str, mx.array]
Ints = Dict[str, int]


class LayerMismatch(ValueError):
    """A stored layer does not fit the cache it is restored into (kind or window)."""


def _rows(a: mx.array, lo: int, hi: int) -> mx.array:
    return a[..., lo:hi, :]


def _take_kv(c: KVCache) -> Tuple[Arrays, Ints]:
    if c.keys is None:
        return {}, {"offset": 0}
    return {"keys": _rows(c.keys, 0, c.offset), "values": _rows(c.values, 0, c.offset)}, {"offset": c.offset}


def _put_kv(c: KVCache, arrays: Arrays, ints: Ints) -> None:
    if ints["offset"]:
        c.keys, c.values = arrays["keys"][...], arrays["values"][...]  # new array objects: the entry stays as it was
    c.offset = ints["offset"]


def _take_quantized(c: QuantizedKVCache) -> Tuple[Arrays, Ints]:
    ints = {"offset": c.offset, "group_size": c.group_size, "bits": c.bits}
    if c.keys is None:
        return {}, {**ints, "offset": 0}
    arrays = {f"keys.{i}": _rows(a, 0, c.offset) for i, a in enumerate(c.keys)}
    arrays.update({f"values.{i}": _rows(a, 0, c.offset) for i, a in enumerate(c.values)})
    return arrays, ints


def _put_quantized(c: QuantizedKVCache, arrays: Arrays, ints: Ints) -> None:
    if (c.group_size, c.bits) != (ints["group_size"], ints["bits"]):
        raise LayerMismatch(f"quantized KV cache {ints['bits']}-bit/{ints['group_size']}, "
                            f"this one {c.bits}-bit/{c.group_size}")
    if ints["offset"]:
        n = sum(1 for k in arrays if k.startswith("keys."))
        c.keys = tuple(arrays[f"keys.{i}"][...] for i in range(n))
        c.values = tuple(arrays[f"values.{i}"][...] for i in range(n))
    c.offset = ints["offset"]


def _take_window(c: WindowKVCache) -> Tuple[Arrays, Ints]:
    ints = {"offset": c.offset, "start": c.start, "window": c.window}
    if c.keys is None:
        return {}, ints
    return {"keys": _rows(c.keys, 0, c.held), "values": _rows(c.values, 0, c.held)}, ints


def _put_window(c: WindowKVCache, arrays: Arrays, ints: Ints) -> None:
    if c.window != ints["window"]:
        raise LayerMismatch(f"sliding window {ints['window']}, this layer's {c.window}")
    if "keys" in arrays:
        c.keys, c.values = arrays["keys"][...], arrays["values"][...]
    c.offset, c.start = ints["offset"], ints["start"]


def _take_gated(c: GatedDeltaCache) -> Tuple[Arrays, Ints]:
    arrays = {f"state.{i}": a for i, a in enumerate(c.cache) if a is not None}
    return arrays, {"offset": c.offset, "slots": len(c.cache)}


def _put_gated(c: GatedDeltaCache, arrays: Arrays, ints: Ints) -> None:
    if len(c.cache) != ints["slots"]:
        raise LayerMismatch(f"Gated-DeltaNet state of {ints['slots']} arrays, this layer's {len(c.cache)}")
    c.cache = [arrays[f"state.{i}"][...] if f"state.{i}" in arrays else None for i in range(ints["slots"])]
    c.offset, c._last = ints["offset"], None  # the last forward is not kept: nothing to roll back into


def _take_context(c: ContextWindowCache) -> Tuple[Arrays, Ints]:
    ints = {"offset": c.offset, "held": c.held, "sink": c.sink, "window": c.window}
    if c.keys is None:
        return {}, ints
    return {"keys": _rows(c.keys, 0, c.held), "values": _rows(c.values, 0, c.held)}, ints


def _put_context(c: ContextWindowCache, arrays: Arrays, ints: Ints) -> None:
    if (c.sink, c.window) != (ints["sink"], ints["window"]):
        raise LayerMismatch(f"drafter context window {ints['sink']},{ints['window']}, this one's {c.sink},{c.window}")
    if "keys" in arrays:
        c.keys, c.values = arrays["keys"][...], arrays["values"][...]
    c.offset, c.held = ints["offset"], ints["held"]


# kind name -> (class, take, put). Exact classes only: a subclass may hold more state.
KINDS: Dict[str, Tuple[type, Callable, Callable]] = {
    "KVCache": (KVCache, _take_kv, _put_kv),
    "QuantizedKVCache": (QuantizedKVCache, _take_quantized, _put_quantized),
    "WindowKVCache": (WindowKVCache, _take_window, _put_window),
    "GatedDeltaCache": (GatedDeltaCache, _take_gated, _put_gated),
    "ContextWindowCache": (ContextWindowCache, _take_context, _put_context),
}


def kind_of(c: Any) -> str:
    """The kind name of a layer cache, or "" when it cannot be stored."""
    name = type(c).__name__
    return name if name in KINDS and type(c) is KINDS[name][0] else ""


def take(c: Any) -> Tuple[Arrays, Ints]:
    """The rows one layer cache holds and the integers that place them.

    Returns:
        ``(arrays, ints)``: arrays are new array objects (views of the rows held, so later
        updates of ``c`` do not change them); ints include ``offset`` (tokens seen).

    Raises:
        LayerMismatch: a cache kind this module does not know (see :data:`KINDS`).
    """
    kind = kind_of(c)
    if not kind:
        raise LayerMismatch(f"cannot store a {type(c).__name__} layer cache")
    return KINDS[kind][1](c)


def put(c: Any, kind: str, arrays: Arrays, ints: Ints) -> None:
    """Fill the fresh layer cache ``c`` from what :func:`take` returned for a ``kind`` cache.

    Raises:
        LayerMismatch: ``c`` is another kind, or another window, bit width or state size.
    """
    if kind_of(c) != kind:
        raise LayerMismatch(f"stored {kind} layer, this cache is a {type(c).__name__}")
    KINDS[kind][2](c, arrays, ints)


def can_go_back(kind: str, ints: Ints, rows: int) -> bool:
    """Whether a ``kind`` cache restored from ``ints`` can be trimmed to ``rows`` tokens
    exactly (decided by the cache class's own ``can_trim``, on a copy without arrays)."""
    cls = KINDS[kind][0]
    c = cls.__new__(cls)
    c.__dict__.update(ints)
    c.__dict__.setdefault("keys", None)
    if cls is GatedDeltaCache:
        c._last = None
    return can_trim(c, ints["offset"] - rows)
