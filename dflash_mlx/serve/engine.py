"""The engine under ``dflash serve``: one pair, one worker thread, a bounded queue.

Each worker turn admits waiting requests while there is room (``max_batch``), prefills ONE
chunk of the oldest request still being prefilled, then runs one step
(:class:`~dflash_mlx.decode.batch.BatchDecoder`) for every decoding request; requests whose
client went away or whose deadline passed leave before it. With ``max_batch`` 1, or a target
whose caches have no batched form (:func:`~dflash_mlx.targets.batch_cache.batch_refusal`),
requests run one at a time in the target's own caches, kept between requests
(:class:`~dflash_mlx.chat.prompt_cache.PairCache`: a prompt that starts with the last one
prefills only the rest). Batched requests use the prompt cache through
:mod:`dflash_mlx.prefix.batch`. Chunks go to the event loop through an ``asyncio.Queue``; a
``prepare`` callable (tokenizing) runs on the worker, and what it raises goes back unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from ..chat.prompt_cache import PairCache
from ..decode.batch import BatchDecoder
from ..decode.batch_join import Joining, StepResult
from ..decode.generate import check_block_size
from ..decode.stopping import StopCondition
from ..decode.width import make_chooser
from ..errors import DFlashError
from ..prefix.resume import PrefillStopped
from ..prefix.store import PrefixStore
from ..sampling import make_sampler
from ..stats import GenerationStats
from ..targets.batch_cache import batch_refusal
from .api import usage
from .lifecycle import release_streams
from .metrics import ServerMetrics
from .text_stream import TextStream

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


@dataclass
class _Request:
    """A request admitted to the engine: its job, text, prefill, timings, and (one at a time)
    the reply so far and the rows the pair cache held of its prompt."""

    job: Job
    spec: GenerationJob
    text: TextStream
    joining: Joining
    reused: int = 0
    reply: List[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None


class Engine:
    """Runs up to ``max_batch`` generation jobs together on one worker thread.

    Args:
        pair: the loaded :class:`dflash_mlx.Pair`.
        max_batch: most requests decoding at once (1: one at a time, in the pair cache).
        block_size: B of every verify (None: the drafter's trained size), or "auto" (a seeded
            sampled request then runs at B, so the same seed gives the same text).
        max_queue: most requests waiting beyond those running; past it, :meth:`submit`
            raises :class:`QueueFullError`.
        metrics: where each generation and step is counted.
        prefill_step_size: prompt tokens per prefill chunk (default 2048): the longest a new
            request's prefill stalls the others.
        store: the prompt cache, or None.

    Attributes:
        pair_cache: both caches, kept between requests (one at a time only; else None).

    Raises:
        InputError: ``block_size`` out of range for the drafter.
    """

    def __init__(self, pair: Any, *, max_batch: int = 1, block_size: Optional[int | str] = None,
                 max_queue: int = 16, metrics: Optional[ServerMetrics] = None,
                 prefill_step_size: Optional[int] = None, store: Optional[PrefixStore] = None):
        self.pair, self.block_size, self.max_queue, self.metrics = pair, block_size, max_queue, metrics
        self.prefill_step_size = prefill_step_size
        solo = max_batch == 1 or batch_refusal(pair.target) is not None
        self.slots = 1 if solo else max_batch
        self.pair_cache = PairCache(pair.target, pair.tokenizer, pair.drafter, store=store) if solo else None
        width = check_block_size(block_size, pair.drafter)
        chooser = None
        if pair.drafter is not None:
            chooser = make_chooser(pair.target, pair.drafter, block_size, None, GenerationStats(block_size=width))
        self.decoder = BatchDecoder(pair.target, pair.drafter, width, chooser, None if solo else store, solo)
        if self.decoder.prefix_refusal is not None:
            log.warning("prompt cache: not used by batched requests, which prefill their whole prompt: %s "
                        "(--max-batch 1 uses it)", self.decoder.prefix_refusal)
        elif store is not None and not solo:
            log.info("prompt cache: batched requests resume from stored prefixes and store their prompts")
        self._lock = threading.Lock()
        self._pending = 0  # jobs submitted and not finished (running or waiting)
        self._jobs: set = set()  # the same jobs, to stop them at shutdown
        self._closing = False
        self._inbox: Deque[Job] = deque()
        self._joining: Deque[_Request] = deque()
        self._active: List[_Request] = []
        self._outbox: Optional[List[tuple]] = None  # during a step: (job, chunk) sent together after it
        self.mismatches = 0  # worker turns that ended with the batch inconsistent (a bug; see inconsistency)
        self._wake = threading.Condition()
        self._worker = threading.Thread(target=self._work, name="dflash-engine", daemon=True)
        self._worker.start()

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
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()

    # -- the worker ---------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._loop()
        finally:
            release_streams()

    def _loop(self) -> None:
        """Admit, prefill one chunk, step the batch; until shutdown with nothing left.
        After every turn the batch is checked (:meth:`inconsistency`)."""
        while True:
            admitted = self._take()
            if admitted is None:
                return
            try:
                for job in admitted:
                    self._admit(job)
                self._drop_stopped()
                if self._joining:
                    self._prefill_chunk()
                if self._active:
                    self._step()
            except Exception as e:  # a bug here: every request in flight gets a 500, the worker goes on
                log.exception("batch step failed")
                self._fail(list(self._joining) + self._active, e)
            try:
                problem = self.inconsistency()
            except Exception as e:  # the check itself broke: as unsafe as a failed check
                problem = f"the check failed: {e!r}"
            if problem is not None:  # a bug: said, counted, and the batch starts afresh
                self.mismatches += 1
                log.error("the batch is inconsistent (%s): every request in flight ends with an error", problem)
                self._fail(list(self._joining) + self._active, RuntimeError(problem))
                self.decoder.clear()

    def inconsistency(self) -> Optional[str]:
        """What breaks the batch's bookkeeping, or None: the decoder's sequences must be
        exactly the engine's decoding requests, in any order (a joining request has no
        sequence yet), and its caches must hold one row per sequence
        (:meth:`BatchDecoder.inconsistency`). The worker checks it after every turn;
        :attr:`mismatches` counts the turns that failed it."""
        keys = [id(s.key) for s in self.decoder.sequences]
        active = [id(r.job) for r in self._active]
        if sorted(keys) != sorted(active):
            return f"{len(keys)} sequences in the decoder for {len(active)} decoding requests"
        return self.decoder.inconsistency()

    def _take(self) -> Optional[List[Job]]:
        """Wait for work; the jobs to admit now (room permitting), or None at shutdown."""
        with self._wake:
            while not self._inbox and not self._joining and not self._active:
                if self._closing:
                    return None
                self._wake.wait(timeout=1.0)
            room = self.slots - len(self._joining) - len(self._active)
            return [self._inbox.popleft() for _ in range(min(room, len(self._inbox)))]

    def _admit(self, job: Job) -> None:
        """Prepare a job (tokenize, check) and start its prefill; or end it at once."""
        waited = time.perf_counter() - job.submitted
        if job.cancelled.is_set():
            log.info("request %s: %s before it started", job.id, self._gone())
            self._count(job, None, "cancelled")
            return self._release(job)
        if job.expired():
            self._timed_out(job, None)
            return self._release(job)
        if self.metrics is not None:
            self.metrics.queue_wait.observe(waited)
        if waited > 0.05:
            log.info("request %s starts after waiting %.2f s", job.id, waited)
        try:
            if job.prepare is not None:
                job.spec = job.prepare()
            req = self._start(job)
        except PrefillStopped:  # closed or past its deadline while the pair cache prefilled
            if job.cancelled.is_set():
                self._count(job, None, "cancelled")
            else:
                self._timed_out(job, None)
            return self._release(job)
        except Exception as e:  # the request's fault (a 400) or a bug (a 500, logged): the handler decides
            job.push(e)
            return self._release(job)
        job.push(_STARTED)
        self._joining.append(req)

    def _start(self, job: Job) -> _Request:
        spec, tokenizer, step = job.spec, self.pair.tokenizer, self.prefill_step_size or 2048
        sampler = make_sampler(spec.temperature, spec.top_p, spec.min_p, spec.top_k, self.pair.target.vocab_size)
        stop = StopCondition(spec.max_tokens, tuple(tokenizer.eos_token_ids), spec.stop, tokenizer.decode)
        seed = spec.seed if spec.temperature > 0 else None
        start, caches = 0, {}
        if self.pair_cache is not None:  # one at a time: in the caches kept from the last request
            pc = self.pair_cache
            try:
                start = pc.begin(spec.ids, step, job.should_stop)
            except BaseException:
                pc.end(spec.ids, len(pc.tokens), False)
                raise
            caches = dict(cache=pc.cache, draft_cache=pc.draft_cache)
        joining = self.decoder.start(job, spec.ids[start:], sampler, stop, step, job.should_stop, seed=seed, **caches)
        if self.pair_cache is not None:
            joining.reused = joining.stats.prompt_reused = self.pair_cache.last_reused
            joining.stats.prompt_tokens = len(spec.ids)
        return _Request(job, spec, TextStream(tokenizer, spec.stop), joining)

    def _end(self, req: _Request, done: bool) -> None:
        """One at a time: the pair cache keeps the rows known complete (and stores them when ``done``)."""
        if self.pair_cache is not None:
            ids = list(req.spec.ids) + req.reply
            known = len(ids) - 1 if req.first is not None else len(self.pair_cache.tokens)
            self.pair_cache.end(ids, known, done)

    def _drop_stopped(self) -> None:
        """Requests closed by their client or past their deadline leave now."""
        for req in [r for r in list(self._joining) + self._active if r.job.should_stop()]:
            if req in self._active:
                self._active.remove(req)
                self.decoder.remove([req.job])
            else:
                self._joining.remove(req)
            self._stopped(req)

    def _stopped(self, req: _Request) -> None:
        stats = req.joining.stats
        if req.job.cancelled.is_set():
            log.info("request %s stopped: %s after %d of %d tokens", req.job.id, self._gone(), stats.generation_tokens,
                     req.spec.max_tokens)
            self._count(req.job, stats, "cancelled", req.joining.reused)
        else:
            self._timed_out(req.job, stats, req.joining.reused)
        self._end(req, False)
        self._release(req.job)

    def _prefill_chunk(self) -> None:
        req = self._joining[0]
        try:
            result = req.joining.advance()
        except PrefillStopped:
            self._joining.popleft()
            return self._stopped(req)
        except Exception as e:  # this request's prefill or join failed: it alone ends
            log.exception("request %s: prefill failed", req.job.id)
            return self._fail([req], e)
        if result is None:
            return
        self._joining.popleft()
        req.first = time.perf_counter()
        req.joining.stats.prompt_s = req.first - req.started
        if result.finish_reason is None:
            self._active.append(req)
        self._emit(req, result)

    def _step(self) -> None:
        """One batched step; a request whose part of it fails ends with an error, the
        others go on (a failed batched forward ends every decoding request)."""
        by_job = {id(r.job): r for r in self._active}
        requests = [by_job[id(s.key)] for s in self.decoder.sequences]
        self._outbox = []
        try:
            try:
                results = self.decoder.step()
            except Exception as e:  # the decoder has emptied the batch
                log.exception("batched step failed: its %d requests end with an error", len(requests))
                return self._fail(requests, e)
            for req, result in zip(requests, results):
                try:
                    if result.error is not None:
                        raise result.error
                    self._emit(req, result)
                except Exception as e:
                    log.error("request %s failed in a batched step: %s: %s", req.job.id, type(e).__name__, e)
                    self._fail([req], e)
        finally:
            outbox, self._outbox = self._outbox, None
            push_together(outbox)
        if self.metrics is not None:
            self.metrics.batch_size.set(len(self.decoder))

    def _emit(self, req: _Request, result: StepResult) -> None:
        """Hand one step's text to the request; at its end, count and release it."""
        stats, last = req.joining.stats, result.finish_reason is not None
        stats.generation_tokens += len(result.tokens)
        req.reply += result.tokens
        stats.generation_s = time.perf_counter() - req.first
        text = req.text.add(result.tokens, last)
        u = usage(stats) if last else None
        self._send(req.job, Chunk(text, result.finish_reason, u))
        if last:
            if req in self._active:
                self._active.remove(req)
            log.info("request %s: %d prompt tokens (%d reused), %d generated, %s, %.1f tokens/s (batched)",
                     req.job.id, len(req.spec.ids), req.joining.reused, stats.generation_tokens,
                     stats.tau_text() or "no drafter", stats.generation_tps)
            self._count(req.job, stats, "completed", req.joining.reused)
            self._end(req, True)
            self._release(req.job)

    def _fail(self, requests: List[_Request], error: BaseException) -> None:
        """End ``requests`` with an error (a 500, or an error event in a stream): out of
        the engine's lists and the decoder's batch, counted, released."""
        for req in requests:
            if req in self._active:
                self._active.remove(req)
            if req in self._joining:
                self._joining.remove(req)
        self.decoder.remove([r.job for r in requests])
        for req in requests:
            self._end(req, False)
            self._send(req.job, Chunk(error=f"generation failed: {type(error).__name__}: {error}"))
            self._count(req.job, None, "error")
            self._release(req.job)

    def _release(self, job: Job) -> None:
        """The job is done (its end is sent); a second call does nothing."""
        with self._lock:
            if job not in self._jobs:
                return
            self._pending -= 1
            self._jobs.discard(job)
        self._gauge()
        self._send(job, None)

    def _send(self, job: Job, chunk: Any) -> None:
        """Push ``chunk`` to ``job`` now, or with the step's other chunks (one wake-up of the event loop)."""
        if self._outbox is None:
            job.push(chunk)
        else:
            self._outbox.append((job, chunk))


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
                reused = reused or 0
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
        with self._wake:
            self._wake.notify()
        if wait:
            self._worker.join()


def make_engine(pair: Any, max_batch: int, metrics: ServerMetrics, **kwargs) -> Engine:
    """The engine for ``--max-batch``; says in the log and in ``dflash_batching`` whether requests
    batch (a target whose caches have no batched form runs them one at a time).

    Args:
        kwargs: :class:`Engine`'s other arguments.
    """
    refusal = batch_refusal(pair.target) if max_batch > 1 else None
    metrics.batching.set(1 if max_batch > 1 and refusal is None else 0)
    if refusal is not None:
        log.warning("--max-batch %d: batching is off for this target, requests run one at a time: %s",
                    max_batch, refusal)
    elif max_batch > 1:
        log.info("continuous batching: up to %d requests decode together", max_batch)
    return Engine(pair, max_batch=max_batch, metrics=metrics, **kwargs)
