"""A request between the HTTP handlers and the engine's worker: the job, its chunks, its errors."""

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import DFlashError


class QueueFullError(DFlashError):
    """Too many requests are waiting for the engine (HTTP 429)."""


class JobCancelled(DFlashError):
    """The job was closed (the client went away) before it started."""


class RequestTimeout(DFlashError):
    """A request ran past its deadline (``--request-timeout``; HTTP 408)."""


_STARTED = object()  # queue marker: prepare() is done, generation begins


@dataclass
class GenerationJob:
    """What one request asks for: the whole prompt's ids, at most ``max_tokens`` (capped by the context), stop
    strings, mlx-lm sampler settings (temperature 0: greedy), a seed, and "chat" or "completions" (metrics)."""

    ids: List[int]
    max_tokens: int
    stop: List[str] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    endpoint: str = "chat"


@dataclass
class Chunk:
    """One step's new text (may be empty), finish_reason ("stop", "length", None), ``usage`` on the last one;
    or ``error`` alone, with its HTTP ``status`` (500: a bug; 408: the deadline passed)."""

    text: str = ""
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    error: Optional[str] = None
    status: int = 500


Prepare = Callable[[], GenerationJob]


def push_together(items: Sequence[Tuple["Job", Any]]) -> None:
    """From the worker thread: hand ``(job, chunk)`` pairs, in order, to their event loops (one wake-up each)."""
    by_loop: Dict[Any, List[Tuple["Job", Any]]] = {}
    for job, chunk in items:
        by_loop.setdefault(job._loop, []).append((job, chunk))
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, group)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            for job, _ in group:
                job.cancelled.set()


def _put_all(group: List[Tuple["Job", Any]]) -> None:
    for job, chunk in group:
        job._queue.put_nowait(chunk)


class Job:
    """A submitted request (``spec``, or a callable the worker runs to make it) whose chunks go to ``loop``:
    ``await start()``, then iterate it (async); ``close()`` to stop it. ``timeout``: seconds (None: never)."""

    def __init__(self, spec: Union[GenerationJob, Prepare], loop: asyncio.AbstractEventLoop,
                 endpoint: Optional[str] = None, timeout: Optional[float] = None):
        self.prepare: Optional[Prepare] = None if isinstance(spec, GenerationJob) else spec
        self.spec: Optional[GenerationJob] = spec if isinstance(spec, GenerationJob) else None
        self.endpoint = endpoint or (self.spec.endpoint if self.spec is not None else "chat")
        self.id = uuid.uuid4().hex[:12]
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._loop, self._queue = loop, asyncio.Queue()
        self._done = self._started = False

    def should_stop(self) -> bool:
        """Closed or past its deadline."""
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)

    def push(self, chunk: Any) -> None:
        """From the worker thread: hand a chunk (None: the end; an exception: prepare failed) to the event loop."""
        push_together([(self, chunk)])

    async def start(self) -> GenerationJob:
        """The prepared :class:`GenerationJob`, once the worker has made it.

        Raises:
            Whatever ``prepare`` raised; :class:`JobCancelled` (closed before it started), :class:`QueueFullError`
            (the server shut down first), :class:`RequestTimeout` (its deadline passed in the queue).
        """
        while not self._started:
            item = await self._queue.get()
            if item is _STARTED:
                self._started = True
                continue
            self._done = True  # the end, prepare's error, or a failure or timeout before it began
            if item is None and self.cancelled.is_set():
                raise JobCancelled("the client went away")
            if item is None:
                raise QueueFullError("the server is shutting down")
            if isinstance(item, BaseException):
                raise item
            raise RequestTimeout(item.error) if item.status == 408 else RuntimeError(item.error)
        return self.spec

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        if not self._started:
            await self.start()
        while not self._done:
            chunk = await self._queue.get()
            if chunk is None:
                self._done = True
                return
            yield chunk

    def close(self) -> None:
        """Stop the generation after its current verify step (or before it starts)."""
        self.cancelled.set()
