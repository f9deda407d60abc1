"""Serving under ``mlx.launch``: rank 0 answers HTTP; every other rank runs the same generations.

Rank 0 sends each generation's :class:`~dflash_mlx.serve.engine.GenerationJob` before it starts,
and at each step whether it goes on, so every rank runs the same forwards (and their all-sums).
In one process every function here is a no-op.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from ..pair.sharded import rank, ranks, share_text


def _flag(value: bool) -> bool:
    """Rank 0's ``value`` on every rank."""
    held = mx.array([int(value) if rank() == 0 else 0])
    return bool(mx.distributed.all_sum(held, stream=mx.cpu)[0].item())


def send_job(spec: Optional[Any]) -> None:
    """Rank 0: the next generation (None: the server stops) to the other ranks."""
    if ranks() > 1 and rank() == 0:
        share_text(lambda: "" if spec is None else json.dumps(asdict(spec)))


def agreed(should_stop: Callable[[], bool]) -> Callable[[], bool]:
    """``should_stop`` as rank 0 answers it, on every rank."""
    return should_stop if ranks() == 1 else (lambda: _flag(should_stop()))


def lockstep(steps: Iterator[Any]) -> Iterator[Any]:
    """``steps``, stopped on every rank where rank 0's consumer stops (closes) it."""
    if ranks() == 1:
        yield from steps
        return
    going = True
    try:
        for step in steps:
            going = False
            yield step
            going = True
            if not _flag(True):
                return
    finally:
        if rank() == 0 and not going:  # closed at a yield: tell the others to stop too
            _flag(False)
        steps.close()


class _Follower:
    """A job the other ranks run: never cancelled, never past a deadline, its output dropped."""

    id = "follower"
    cancelled = threading.Event()

    def __init__(self, spec: Any):
        self.spec, self.endpoint, self.submitted = spec, spec.endpoint, time.perf_counter()

    def expired(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False

    def push(self, chunk: Any) -> None:
        pass


def follow(engine: Any) -> None:
    """Ranks other than 0: run each generation rank 0 sends through ``engine`` until it stops."""
    from .engine import GenerationJob

    while True:
        text = share_text(lambda: "")
        if not text:
            return
        engine._generate(_Follower(GenerationJob(**json.loads(text))))
