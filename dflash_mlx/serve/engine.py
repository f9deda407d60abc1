"""The engine under ``dflash serve``: one pair, one worker thread, a bounded queue.

Requests run one at a time (no interleaving inside the engine) on a single worker
thread, so the event loop stays free for health checks, metrics and 429s while MLX
works. Both caches are kept between requests in a :class:`PairCache`, so a request
whose prompt starts with the previous prompt and reply prefills only the rest.

A request's steps are handed to the event loop through an ``asyncio.Queue``. Closing
a :class:`Job` (the client went away) stops its generation after the current verify
step; the caches are settled to the rows known complete before the next job starts.
So does its deadline (``--request-timeout``), checked at the same points.

A job may come as a ``prepare`` callable instead of a finished :class:`GenerationJob`:
the worker calls it first, so tokenizing a prompt (and rendering its chat template)
happens one request at a time inside the same bounded queue as generation, never
in the request handlers. What ``prepare`` raises goes back to the request unchanged
(:meth:`Job.start` re-raises it: a 400 for the server).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..errors import DFlashError
from ..decode.generate import PrefillStopped
from ..prompt_cache.pair import PairCache
from ..sampling import make_sampler
from .api import usage
from .lifecycle import release_streams
from .metrics import ServerMetrics
from .ranks import agreed, lockstep, send_job

log = logging.getLogger("dflash.serve")


class QueueFullError(DFlashError):
    """Too many requests are waiting for the engine (HTTP 429)."""


class JobCancelled(DFlashError):
    """The job was closed (the client went away) before it started."""


class RequestTimeout(DFlashError):
    """A request ran past its deadline (``--request-timeout``; HTTP 408)."""


_STARTED = object()  # queue marker: prepare() is done, generation begins


@dataclass
class GenerationJob:
    """What one request asks the engine for.

    Attributes:
        ids: prompt token ids, whole (the engine finds what the caches hold).
        max_tokens: most tokens to generate (already capped by the context).
        stop: stop strings (the text ends before the first match).
        temperature, top_p, top_k, min_p: mlx-lm sampler settings; 0 is greedy.
        seed: PRNG seed set before this generation, or None.
        endpoint: "chat" or "completions", for the metrics.
    """

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
    """One verify step's output, as the event loop receives it.

    Attributes:
        text: new text (may be empty: held back while a stop string may begin).
        finish_reason: "stop", "length", or None while it goes on.
        usage: on the last chunk, the ``usage`` object (see ``server_api.usage``).
        error: set (with nothing else) when the generation failed or timed out.
        status: the HTTP status of ``error`` (500: a bug; 408: the deadline passed).
    """

    text: str = ""
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    error: Optional[str] = None
    status: int = 500


Prepare = Callable[[], GenerationJob]


def push_together(items: Sequence[Tuple["Job", Any]]) -> None:
    """From the worker thread: hand chunks of several jobs (in order) to their event
    loops with one wake-up per loop, not one per chunk (a batched step makes a chunk
    for every request in the batch)."""
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
    """A submitted request: ``await start()``, then iterate it (async) for its chunks;
    ``close()`` to stop it.

    Args:
        spec: the generation, or a ``prepare`` callable the worker runs to make it.
        loop: the event loop the chunks go to.
        endpoint: "chat" or "completions", for the metrics (default: the spec's).
        timeout: seconds from submission after which the generation stops (None: never).
    """

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

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def should_stop(self) -> bool:
        """Closed or past its deadline (checked between prefill chunks and verify steps)."""
        return self.cancelled.is_set() or self.expired()

    def push(self, chunk: Any) -> None:
        """From the worker thread: hand a chunk (None: the end; an exception: prepare
        failed) to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancelled.set()

    async def start(self) -> GenerationJob:
        """Wait until the worker has prepared the job (its prompt tokenized and checked).

        Returns:
            The prepared :class:`GenerationJob`.

        Raises:
            Whatever ``prepare`` raised; :class:`JobCancelled` when it was closed before
            it started; :class:`QueueFullError` when the server shut down first;
            :class:`RequestTimeout` when its deadline passed in the queue.
        """
        while not self._started:
            item = await self._queue.get()
            if item is _STARTED:
                self._started = True
            elif item is None:
                self._done = True
                if self.cancelled.is_set():
                    raise JobCancelled("the client went away")
                raise QueueFullError("the server is shutting down")
            elif isinstance(item, BaseException):
                self._done = True
                raise item
            elif isinstance(item, Chunk) and item.error:  # failed or timed out before it began
                self._done = True
                if item.status == 408:
                    raise RequestTimeout(item.error)
                raise RuntimeError(item.error)
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


class Engine:
    """Runs generation jobs one at a time on one worker thread.

    Args:
        pair: the loaded :class:`dflash_mlx.Pair`.
        block_size: B for every request (default: the drafter's trained size), or "auto"
            (the CLI default). A seeded request at T > 0 runs at the trained size, so
            the same seed gives the same text (auto's widths follow timings).
        max_queue: most requests waiting behind the running one; past it,
            :meth:`submit` raises :class:`QueueFullError`.
        metrics: where each generation is counted.
        prefill_step_size: prompt tokens per prefill chunk (None: generate's default);
            a closed or timed-out job stops between two chunks.
        store: the prompt cache kept beyond the previous request (a
            :class:`dflash_mlx.prompt_cache.store.PrefixStore`), or None.

    Attributes:
        pair_cache: both caches, kept between requests.
    """

    def __init__(self, pair: Any, *, block_size: Optional[int] = None, max_queue: int = 16,
                 metrics: Optional[ServerMetrics] = None, prefill_step_size: Optional[int] = None,
                 store: Optional[Any] = None):
        self.pair, self.block_size, self.max_queue = pair, block_size, max_queue
        self.slots = 1  # requests that run at once (the batching engine runs more)
        self.prefill_step_size = prefill_step_size
        self.pair_cache = PairCache(pair.target, pair.tokenizer, pair.drafter, store=store)
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-engine")
        self._lock = threading.Lock()
        self._pending = 0  # jobs submitted and not finished (running or waiting)
        self._jobs: set = set()  # the same jobs, to stop them at shutdown
        self._closing = False

    @property
    def pending(self) -> int:
        """Jobs running or waiting."""
        return self._pending

    def submit(self, spec: Union[GenerationJob, Prepare], endpoint: Optional[str] = None,
               timeout: Optional[float] = None) -> Job:
        """Queue a job; call from the event loop.

        Args:
            spec: the generation, or a callable the worker runs first to make it
                (tokenizing there, inside the queue's bound).
            endpoint: "chat" or "completions" (default: the spec's).
            timeout: seconds from now after which the job stops (None: no limit).

        Raises:
            QueueFullError: ``max_queue`` jobs already wait behind the running one.
        """
        job = Job(spec, asyncio.get_running_loop(), endpoint, timeout)
        with self._lock:
            ahead = self._pending - (self.slots - 1)  # beyond the requests that run at once
            if self._closing:
                raise QueueFullError("the server is shutting down")
            if ahead > self.max_queue:
                raise QueueFullError(
                    f"the server is busy: {ahead - 1} requests are waiting (the queue holds "
                    f"{self.max_queue}); retry later")
            self._pending += 1
            self._jobs.add(job)
        self._gauge()
        if ahead > 0:
            log.info("request %s waits: %d ahead of it in the queue", job.id, ahead)
        self._dispatch(job)
        return job

    def _dispatch(self, job: Job) -> None:
        """Hand a submitted job to the worker."""
        self._executor.submit(self._run, job)

    def _run(self, job: Job) -> None:
        try:
            waited = time.perf_counter() - job.submitted
            if job.cancelled.is_set():
                log.info("request %s: %s before it started", job.id, self._gone())
                self._count(job, None, "cancelled")
                return
            if job.expired():
                self._timed_out(job, None)
                return
            if waited > 0.05:
                log.info("request %s starts after waiting %.2f s", job.id, waited)
            if self.metrics is not None:
                self.metrics.queue_wait.observe(waited)
            if job.prepare is not None:
                try:
                    job.spec = job.prepare()
                except Exception as e:  # the request's fault (a 400) or a bug: the handler decides
                    job.push(e)
                    return
            job.push(_STARTED)
            self._generate(job)
        except Exception as e:  # a bug: the client gets a 500 / an error event, not a traceback
            log.exception("request %s failed", job.id)
            job.push(Chunk(error=f"generation failed: {type(e).__name__}: {e}"))
            self._count(job, None, "error")
        finally:
            with self._lock:
                self._pending -= 1
                self._jobs.discard(job)
            self._gauge()
            job.push(None)

    def _generate(self, job: Job) -> None:
        spec = job.spec
        send_job(spec)  # to the other ranks under mlx.launch
        if spec.seed is not None:
            mx.random.seed(spec.seed)
        sampler = make_sampler(spec.temperature, spec.top_p, spec.min_p, spec.top_k,
                               self.pair_cache.target.vocab_size)  # a Sampling: mlx-lm's sampler and its p
        block_size = self.block_size
        if spec.seed is not None and spec.temperature > 0 and block_size == "auto":
            # Reproducible draws need the same verify widths every time; auto's follow timings.
            block_size = None
        prefill = {} if self.prefill_step_size is None else {"prefill_step_size": self.prefill_step_size}
        steps = lockstep(self.pair_cache.stream(spec.ids, sampler=sampler, max_tokens=spec.max_tokens,
                                                block_size=block_size, stop_strings=spec.stop,
                                                should_stop=agreed(job.should_stop), **prefill))
        stats, outcome = None, "cancelled"
        try:
            for r in steps:
                stats = r.stats
                if job.cancelled.is_set():
                    break
                if job.expired():
                    outcome = "timeout"
                    break
                last = r.finish_reason is not None
                u = usage(r.stats) if last else None
                job.push(Chunk(r.text, r.finish_reason, u))
                if last:
                    outcome = "completed"
                    log.info("request %s: %d prompt tokens (%d reused), %d generated, %s, %.1f tokens/s",
                             job.id, len(spec.ids), self.pair_cache.last_reused, r.stats.generation_tokens,
                             r.stats.tau_text() or "no drafter", r.stats.generation_tps)
        except PrefillStopped:  # closed or timed out while its prompt was prefilled
            outcome = "cancelled" if job.cancelled.is_set() else "timeout"
        finally:
            steps.close()  # settles both caches, whatever happened
        if outcome == "cancelled":
            n = stats.generation_tokens if stats is not None else 0
            log.info("request %s stopped: %s after %d of %d tokens", job.id, self._gone(), n, spec.max_tokens)
        if outcome == "timeout":
            self._timed_out(job, stats)
            return
        self._count(job, stats, outcome)

    def _timed_out(self, job: Job, stats, reused: Optional[int] = None) -> None:
        n = stats.generation_tokens if stats is not None else 0
        log.info("request %s stopped: past its deadline after %d tokens", job.id, n)
        self._count(job, stats, "timeout", reused)  # before the client hears of it, so /metrics agrees
        job.push(Chunk(error="the request ran past the server's --request-timeout", status=408))

    def _count(self, job: Job, stats, outcome: str, reused: Optional[int] = None) -> None:
        """Count a request's outcome and generation; ``reused``: its prompt tokens found in
        the caches (None: the pair cache's last generation's)."""
        if self.metrics is not None:
            self.metrics.request(job.endpoint, outcome)
            if stats is not None:
                reused = self.pair_cache.last_reused if reused is None else reused
                self.metrics.generation(stats, len(job.spec.ids), reused, time.perf_counter() - job.submitted)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(self._pending)

    @property
    def closing(self) -> bool:
        """Whether :meth:`shutdown` was called (jobs stopped since were stopped by it)."""
        return self._closing

    def _gone(self) -> str:
        return "stopped by the shutdown" if self._closing else "client gone"

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking jobs; the running one stops after its step, waiting ones end at once.
        ``wait``: return once the worker thread has ended, its MLX streams synchronized and
        released (:func:`~dflash_mlx.serve.lifecycle.release_streams`)."""
        with self._lock:
            first, self._closing = not self._closing, True
            for job in self._jobs:
                job.close()
        self._stop_worker(first, wait)

    def _stop_worker(self, first: bool, wait: bool) -> None:
        if first:  # the worker's last task, after the jobs queued before it (which end at once)
            self._executor.submit(release_streams)
        self._executor.shutdown(wait=wait)

