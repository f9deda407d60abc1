"""A prompt fed to a target in chunks, with the context features of ``capture`` kept (the benchmarks'
prefill; the package prefills inside ``BatchDecoder``'s ``Joining``)."""

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx


def prefill(target: Any, prompt: mx.array, cache: List[Any], capture: Optional[Sequence[int]],
            step: int = 2048) -> Tuple[mx.array, Optional[mx.array]]:
    """Feed ``prompt`` ([P] int32) into ``cache`` ``step`` tokens at a time, each chunk evaluated: ``(the last
    chunk's hidden states [1, n, H], features [1, P, F] or None without ``capture``)``."""
    hidden, features = None, []
    for i in range(0, prompt.size, step):
        hidden, f = target(prompt[None, i:i + step], cache, capture)
        mx.eval(hidden, [c.state for c in cache], f if f is not None else [])
        features.append(f)
    return hidden, mx.concatenate(features, axis=1) if capture else None
