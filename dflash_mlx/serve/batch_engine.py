"""The batching engine of ``dflash serve --max-batch N`` (N > 1): continuous batching.

Up to N requests decode together on one worker thread: each loop turn admits waiting
requests while there is room, prefills ONE chunk of the oldest request still being
prefilled (so a new prompt never stalls the others longer than one chunk), then runs
one batched draft + verify step for every active request
(:class:`dflash_mlx.decode.batch.BatchDecoder`). A request whose client went away, or
whose deadline passed, leaves the batch before the next step; nothing else changes
for the others. Requests are submitted, bounded (429) and consumed exactly as with the
one-at-a-time :class:`~dflash_mlx.serve.engine.Engine`, whose :class:`Job` this reuses.

:func:`make_engine` picks the engine: every target family here batches exactly
(attention, Gated-DeltaNet hybrids, sliding-window layers); a target the batch path
cannot run (a layer cache with no batched form, see
:func:`dflash_mlx.prompt_cache.batch.batch_refusal`) is served one request at a time,
with a warning in the log and ``dflash_batching 0`` in ``/metrics``.

The prompt cache (a :class:`~dflash_mlx.prompt_cache.store.PrefixStore`): each batched
request resumes from the longest stored prefix of its prompt, prefills only the rest and
stores its prompt, in memory and on disk (:mod:`dflash_mlx.prompt_cache.batch_prefix`), where every
layer cache of the target and the drafter is a plain attention KV cache and the drafter
drafts the batch in one pass (or there is none). Elsewhere (Gated-DeltaNet hybrids,
sliding-window layers, drafters without a batched pass) batched requests prefill their
whole prompt, and the log says so once at start, with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Optional

from ..decode.batch import BatchDecoder, Joining
from ..decode.width import make_chooser
from ..decode.generate import PrefillStopped, StepResult, check_block_size
from ..decode.stopping import StopCondition
from ..prompt_cache.store import PrefixStore
from ..sampling import make_sampler
from ..prompt_cache.batch import batch_refusal
from .api import usage
from .engine import _STARTED, Chunk, Engine, GenerationJob, Job, push_together
from .lifecycle import release_streams
from .metrics import ServerMetrics
from .text_stream import TextStream

log = logging.getLogger("dflash.serve")


@dataclass
class _Request:
    """A request admitted to the batch: its job, text, timings and prefill."""

    job: Job
    spec: GenerationJob
    text: TextStream
    joining: Joining
    started: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None


class BatchEngine(Engine):
    """Runs up to ``max_batch`` generation jobs together on one worker thread.

    Args:
        pair: the loaded :class:`dflash_mlx.Pair`; its target must batch
            (:func:`~dflash_mlx.prompt_cache.batch.batch_refusal` is None).
        max_batch: most requests decoding at once (>= 2).
        block_size: B of every verify (None: the drafter's trained size); "auto":
            one width per batched step, chosen from the batch's measured step times
            and pooled acceptance (:mod:`dflash_mlx.decode.width`).
        max_queue: most requests waiting beyond the ``max_batch`` running; past it,
            :meth:`submit` raises :class:`~dflash_mlx.serve.engine.QueueFullError`.
        metrics: where each generation and step is counted.
        prefill_step_size: prompt tokens per prefill chunk (default 2048): the longest
            a new request's prefill stalls the batch.
        store: the prompt cache, or None; see the module docstring for where it is used.

    Raises:
        InputError: ``block_size`` out of range for the drafter.
    """

    def __init__(self, pair: Any, *, max_batch: int, block_size: Optional[int | str] = None, max_queue: int = 16,
                 metrics: Optional[ServerMetrics] = None, prefill_step_size: Optional[int] = None,
                 store: Optional[PrefixStore] = None):
        super().__init__(pair, block_size=block_size, max_queue=max_queue, metrics=metrics,
                         prefill_step_size=prefill_step_size)
        self.slots = max_batch
        width = check_block_size(block_size, pair.drafter)
        widths = make_chooser(None, pair.drafter, "auto", None, None) if block_size == "auto" and pair.drafter else None
        self.decoder = BatchDecoder(pair.target, pair.drafter, width, widths, store=store)
        if self.decoder.prefix_refusal is not None:
            log.warning("prompt cache: not used by batched requests, which prefill their whole prompt: %s "
                        "(--max-batch 1 uses it)", self.decoder.prefix_refusal)
        elif store is not None:
            log.info("prompt cache: batched requests resume from stored prefixes and store their prompts")
        self._inbox: Deque[Job] = deque()
        self._joining: Deque[_Request] = deque()
        self._active: List[_Request] = []
        self._outbox: Optional[List[tuple]] = None  # during a step: (job, chunk) sent together after it
        self.mismatches = 0  # worker turns that ended with the batch inconsistent (a bug; see inconsistency)
        self._wake = threading.Condition()
        self._worker = threading.Thread(target=self._work, name="dflash-engine-batch", daemon=True)
        self._worker.start()

    def _dispatch(self, job: Job) -> None:
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()

    def _stop_worker(self, first: bool, wait: bool) -> None:
        with self._wake:
            self._wake.notify()
        if wait:
            self._worker.join()

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
        except Exception as e:  # the request's fault (a 400) or a bug (a 500, logged): the handler decides
            job.push(e)
            return self._release(job)
        job.push(_STARTED)
        self._joining.append(req)

    def _start(self, job: Job) -> _Request:
        spec, tokenizer = job.spec, self.pair.tokenizer
        sampler = make_sampler(spec.temperature, spec.top_p, spec.min_p, spec.top_k, self.pair.target.vocab_size)
        stop = StopCondition(spec.max_tokens, tuple(tokenizer.eos_token_ids), spec.stop, tokenizer.decode)
        step = self.prefill_step_size or 2048
        joining = self.decoder.start(job, spec.ids, sampler, stop, step, job.should_stop,
                                     seed=spec.seed if spec.temperature > 0 else None)
        return _Request(job, spec, TextStream(tokenizer, spec.stop), joining)

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


def make_engine(pair: Any, max_batch: int, metrics: ServerMetrics, **kwargs) -> Engine:
    """The engine for ``--max-batch``: :class:`BatchEngine` when ``max_batch`` > 1 and the
    target can batch exactly (every family here, sliding-window ones included; see
    :func:`~dflash_mlx.prompt_cache.batch.batch_refusal`), else the one-at-a-time
    :class:`Engine`. Says which in the log and in ``dflash_batching``.

    Args:
        kwargs: the engines' shared arguments (block_size, max_queue, prefill_step_size,
            store). ``store``, the prompt cache, goes to either engine: the one-at-a-time
            engine always uses it; the batching engine where the drafter drafts the
            batch in one pass or there is none (else it says once in the log why
            batched requests prefill their whole prompt).
    """
    store = kwargs.pop("store", None)
    refusal = batch_refusal(pair.target) if max_batch > 1 else None
    if max_batch > 1 and refusal is None:
        metrics.batching.set(1)
        log.info("continuous batching: up to %d requests decode together", max_batch)
        return BatchEngine(pair, max_batch=max_batch, metrics=metrics, store=store, **kwargs)
    metrics.batching.set(0)
    if refusal is not None:
        log.warning("--max-batch %d: batching is off for this target, requests run one at a time: %s",
                    max_batch, refusal)
    return Engine(pair, metrics=metrics, store=store, **kwargs)
