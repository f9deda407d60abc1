"""Prefill to stored states' boundaries (whole prefill chunks) for pairs whose caches cannot go back far:
an entry then resumes a prompt only at its exact row count."""

from typing import Any, Callable, Iterator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, QuantizedKVCache

DEFAULT_INTERVAL = 4096  # tokens between stored states (rounded to whole prefill chunks)


class PrefillStopped(Exception):
    """``should_stop()`` turned true between two prefill chunks; the caches hold the chunks done."""


def trims_anywhere(*caches: Optional[List[Any]]) -> bool:
    """Whether every layer of these caches can be trimmed to any row count (attention KV caches only)."""
    return all(isinstance(c, (KVCache, QuantizedKVCache)) for cache in caches if cache is not None for c in cache)


def boundary_interval(step: int, interval: Optional[int] = None) -> int:
    """``interval`` (default :data:`DEFAULT_INTERVAL`) rounded to at least one whole chunk of ``step``."""
    want = DEFAULT_INTERVAL if interval is None else interval
    return step * max(1, round(want / step))


def boundaries(start: int, prompt_len: int, every: int) -> List[int]:
    """Multiples of ``every`` after ``start``, then ``prompt_len - 1`` (the generation feeds the last token)."""
    first = (start // every + 1) * every
    stops = list(range(first, prompt_len - 1, every))
    return stops + [prompt_len - 1] if prompt_len - 1 > start else stops


def prefill_to(target: Any, drafter: Optional[Any], cache: List[Any], draft_cache: Optional[List[Any]],
               ids: Sequence[int], start: int, stops: Sequence[int], step: int,
               should_stop: Optional[Callable[[], bool]] = None) -> Iterator[int]:
    """Feed ``ids`` up to each boundary ``b`` of ``stops`` in chunks ending at multiples of ``step`` (the
    drafter ingesting), yielding ``b`` once both caches hold ``b`` rows.

    Raises:
        PrefillStopped: ``should_stop()`` was true before a chunk.
    """
    capture = drafter.target_layer_ids if drafter is not None else None
    pos = start
    with mx.stream(generation_stream):
        for b in stops:
            while pos < b:
                if should_stop is not None and should_stop():
                    raise PrefillStopped()
                n = min(step - pos % step, b - pos)  # chunks end at multiples of step, as from row 0
                _, f = target(mx.array(ids[pos:pos + n], dtype=mx.int32)[None], cache, capture)
                if drafter is not None:
                    drafter.ingest(f, draft_cache)
                mx.eval([c.state for c in cache] + ([c.state for c in draft_cache] if draft_cache else []))
                pos += n
                mx.clear_cache()
            yield b
