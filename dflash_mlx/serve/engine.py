"""The engine under ``dflash serve``: one worker thread, a bounded queue, up to ``max_batch`` requests decoding
together; one at a time (in a :class:`~dflash_mlx.prompt_cache.pair.PairCache`) when the target cannot batch."""

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Union

from ..decode.batch import BatchDecoder
from ..decode.batch_join import BatchedCaches, Joining, OwnCaches, StepResult
from ..decode.generate import check_block_size
from ..decode.stopping import StopCondition, TextStream
from ..decode.width import make_chooser
from ..pair.sharded import agreed, ranks
from ..prompt_cache.batch import not_batchable
from ..prompt_cache.pair import PairCache
from ..prompt_cache.resume import PrefillStopped
from ..prompt_cache.store import PrefixStore
from ..sampling import Sampling
from .api import usage
from .jobs import _STARTED, Chunk, GenerationJob, Job, Prepare, QueueFullError, push_together
from .lifecycle import release_streams
from .metrics import ServerMetrics
from .ranks import Lockstep

log = logging.getLogger("dflash.serve")


@dataclass
class _Request:
    """A request admitted to the engine: its job, text, prefill, reply so far and timings."""

    job: Job
    text: TextStream
    joining: Joining
    reply: List[int] = field(default_factory=list)
    first: Optional[float] = None


class Engine:
    """Runs up to ``max_batch`` generation jobs of ``pair`` together on one worker thread.

    ``block_size``: B (None: the drafter's trained size; "auto"); ``max_queue``: most jobs waiting beyond those
    running; ``prefill_step_size``: prompt tokens per chunk (2048); ``store``: the prompt cache, or None;
    ``prompt_lookup``: copy drafts from the context (one request at a time only).
    Under ``mlx.launch`` with several ranks: one request at a time, no prompt store, the ranks in lockstep
    (:mod:`.ranks`). InputError: ``block_size`` out of range for the drafter.
    """

    def __init__(self, pair: Any, *, max_batch: int = 1, block_size: Optional[int | str] = None, max_queue: int = 16,
                 metrics: Optional[ServerMetrics] = None, prefill_step_size: Optional[int] = None,
                 store: Optional[PrefixStore] = None, prompt_lookup: bool = False):
        self.pair, self.max_queue, self.prefill_step_size = pair, max_queue, prefill_step_size
        self.metrics = metrics or ServerMetrics()
        self.lockstep = Lockstep() if ranks() > 1 else None
        if self.lockstep is not None and (max_batch > 1 or store is not None):
            log.warning("%d ranks: requests run one at a time (--max-batch 1), without the prompt cache on disk",
                        ranks())
            max_batch, store = 1, None
        unbatchable = not_batchable(pair.target) if max_batch > 1 else None
        solo = max_batch == 1 or unbatchable is not None
        self.metrics.batching.set(0 if solo else 1)
        if unbatchable is not None:
            log.warning("--max-batch %d: batching is off for this target, requests run one at a time: %s",
                        max_batch, unbatchable)
        elif not solo:
            log.info("continuous batching: up to %d requests decode together", max_batch)
        self.slots = 1 if solo else max_batch
        self.pair_cache = PairCache(pair.target, pair.tokenizer, pair.drafter, store=store) if solo else None
        width = check_block_size(block_size, pair.drafter)
        chooser = make_chooser(pair.target, pair.drafter, block_size, None) if pair.drafter is not None else None
        self.decoder = BatchDecoder(pair.target, pair.drafter, width, chooser, None if solo else store,
                                    OwnCaches() if solo else BatchedCaches(), lookup=prompt_lookup)
        if self.decoder.prefix_off is not None:
            log.warning("prompt cache: not used by batched requests, which prefill their whole prompt: %s "
                        "(--max-batch 1 uses it)", self.decoder.prefix_off)
        elif store is not None and not solo:
            log.info("prompt cache: batched requests resume from stored prefixes and store their prompts")
        self._lock, self._jobs = threading.Lock(), set()  # jobs not done
        self.closing = False  # shutdown() was called
        self._inbox: Deque[Job] = deque()
        self._requests: Dict[Any, _Request] = {}  # admitted (prefilling or decoding), by job id
        self._joining: Deque[Joining] = deque()  # those prefilling, in order
        self._outbox: Optional[List[tuple]] = None  # during a step: (job, chunk) sent together after it
        self.mismatches = 0  # worker turns that ended with the batch inconsistent (a bug; see inconsistency)
        self._wake = threading.Condition()
        self._worker = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._worker.start()

    @property
    def pending(self) -> int:  # jobs running or waiting
        return len(self._jobs)

    def submit(self, spec: Union[GenerationJob, Prepare], endpoint: Optional[str] = None,
               timeout: Optional[float] = None) -> Job:
        """Queue a job from the event loop (``spec``, or a callable the worker runs to make it); ``timeout``: seconds.

        Raises:
            QueueFullError: ``max_queue`` jobs already wait behind the running one.
        """
        job = Job(spec, asyncio.get_running_loop(), endpoint, timeout)
        with self._lock:
            ahead = len(self._jobs) - (self.slots - 1)  # beyond the requests that run at once
            if self.closing:
                raise QueueFullError("the server is shutting down")
            if ahead > self.max_queue:
                raise QueueFullError(f"the server is busy: {ahead - 1} requests are waiting (the queue holds "
                                     f"{self.max_queue}); retry later")
            self._jobs.add(job)
            self.metrics.queue.set(len(self._jobs))
        if ahead > 0:
            log.info("request %s waits: %d ahead of it in the queue", job.id, ahead)
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()
        return job

    def _loop(self) -> None:
        """Admit, prefill one chunk, step the batch (then check it) until shutdown with nothing left."""
        try:
            while (admitted := self._take()) is not None:
                self._turn(admitted)
        finally:
            if self.lockstep is not None:
                self.lockstep.end()
            release_streams()

    def _turn(self, admitted: List[Job]) -> None:
        try:
            for job in admitted:
                self._admit(job)
            for req in [r for r in self._requests.values() if self._stops(r.job)]:
                self._detach([req])  # closed by its client or past its deadline: it leaves now
                self._stopped(req.job, req)
            if self._requests:
                self._run_turn()
        except Exception as e:  # a bug here: every request in flight gets a 500, the worker goes on
            log.exception("batch step failed")
            self._fail(list(self._requests.values()), e)
        try:
            problem = self.inconsistency()
        except Exception as e:  # the check itself broke: as unsafe as a failed check
            problem = f"the check failed: {e!r}"
        if problem is not None:  # a bug: said, counted, and the batch starts afresh
            self.mismatches += 1
            log.error("the batch is inconsistent (%s): every request in flight ends with an error", problem)
            self._fail(list(self._requests.values()), RuntimeError(problem))
            self.decoder.clear()

    def inconsistency(self) -> Optional[str]:
        """What breaks the bookkeeping (decoder sequences == decoding requests, one cache row each), or None."""
        keys = [s.key for s in self.decoder.sequences]
        joining = {j.key for j in self._joining}
        active = [k for k in self._requests if k not in joining]
        if sorted(keys) != sorted(active):
            return f"{len(keys)} sequences in the decoder for {len(active)} decoding requests"
        return self.decoder.inconsistency()

    def _take(self) -> Optional[List[Job]]:
        """Wait for work; the jobs to admit now (room permitting), or None at shutdown."""
        if self.lockstep is not None and not self.lockstep.leader:  # the job rank 0 starts next
            if self._requests:
                return []
            job = self.lockstep.receive()
            return None if job is None else [job]
        with self._wake:
            while not self._inbox and not self._requests:
                if self.closing:
                    return None
                self._wake.wait(timeout=1.0)
            room = self.slots - len(self._requests)
            return [self._inbox.popleft() for _ in range(min(room, len(self._inbox)))]

    def _admit(self, job: Job) -> None:
        """Prepare a job (tokenize, check) and start its prefill; or end it at once."""
        waited = time.perf_counter() - job.submitted
        if job.should_stop():
            return self._stopped(job)
        self.metrics.queue_wait.observe(waited)
        if waited > 0.05:
            log.info("request %s starts after waiting %.2f s", job.id, waited)
        try:
            if job.prepare is not None:
                job.spec = job.prepare()
            if self.lockstep is not None:
                self.lockstep.send(job.spec)
            req = self._start(job)
        except PrefillStopped:  # closed or past its deadline while the pair cache prefilled
            return self._stopped(job)
        except Exception as e:  # the request's fault (a 400) or a bug (a 500, logged): the handler decides
            job.push(e)
            return self._release(job)
        job.push(_STARTED)
        self._requests[job.id] = req
        self._joining.append(req.joining)

    def _start(self, job: Job) -> _Request:
        spec, tokenizer, step = job.spec, self.pair.tokenizer, self.prefill_step_size or 2048
        sampler = Sampling(spec.temperature, spec.top_p, spec.min_p, spec.top_k, self.pair.target.vocab_size)
        stop = StopCondition(spec.max_tokens, tuple(tokenizer.eos_token_ids), spec.stop, tokenizer.decode)
        seed = spec.seed if spec.temperature > 0 else None
        start, caches = 0, {}
        if self.pair_cache is not None:  # one at a time: in the caches kept from the last request
            pc = self.pair_cache
            try:
                start = pc.begin(spec.ids, step, lambda: self._stops(job))
            except BaseException:
                pc.end(spec.ids, len(pc.tokens), False)
                raise
            caches = dict(cache=pc.cache, draft_cache=pc.draft_cache, history=spec.ids[:start])  # lookup's context too
        joining = self.decoder.start(job.id, spec.ids[start:], sampler, stop, step, lambda: self._stops(job), seed=seed,
                                     **caches)
        if self.pair_cache is not None:
            joining.reused = joining.stats.prompt_reused = self.pair_cache.last_reused
            joining.stats.prompt_tokens = len(spec.ids)
        return _Request(job, TextStream(tokenizer, spec.stop), joining)

    def _end(self, req: _Request, done: bool) -> None:
        """One at a time: the pair cache keeps the rows known complete (and stores them when ``done``)."""
        if self.pair_cache is not None:
            ids = list(req.job.spec.ids) + req.reply
            known = len(ids) - 1 if req.first is not None else len(self.pair_cache.tokens)
            self.pair_cache.end(ids, known, done)

    def _stops(self, job: Job) -> bool:
        """Whether a started job stops (closed, or past its deadline): rank 0 decides for every rank."""
        return job.should_stop() if self.lockstep is None else agreed(job.should_stop())

    def _stopped(self, job: Job, req: Optional[_Request] = None) -> None:
        """``job`` (``req`` once admitted), closed or past its deadline, ends: counted, told, released."""
        stats, reused = (req.joining.stats, req.joining.reused) if req is not None else (None, None)
        n = stats.generation_tokens if stats is not None else 0
        if job.cancelled.is_set():
            gone = "stopped by the shutdown" if self.closing else "client gone"
            log.info("request %s stopped: %s after %d tokens", job.id, gone, n)
            self._count(job, stats, "cancelled", reused)
        else:
            log.info("request %s stopped: past its deadline after %d tokens", job.id, n)
            self._count(job, stats, "timeout", reused)  # before the client hears of it, so /metrics agrees
            job.push(Chunk(error="the request ran past the server's --request-timeout", status=408))
        if req is not None:
            self._end(req, False)
        self._release(job)

    def _run_turn(self) -> None:
        """One turn of the decode loop (:meth:`BatchDecoder.turn`, ``stream_generate``'s): a request whose part
        fails ends with an error, alone (a failed forward ends them all); the step's chunks are sent together."""
        self._outbox = []
        self.decoder.waiting = bool(self._joining) or len(self._jobs) > len(self._requests)  # see plan()'s behind
        try:
            for key, result in self.decoder.turn(self._joining):
                req = self._requests[key]
                try:
                    if isinstance(result.error, PrefillStopped):
                        self._detach([req])
                        self._stopped(req.job, req)
                        continue
                    if result.error is not None:
                        raise result.error
                    first, req.first = req.first is None, req.first or time.perf_counter()
                    self._emit(req, result)
                    if first:  # the first token goes out before the step
                        self._flush([])
                except Exception as e:
                    log.error("request %s failed: %s: %s", req.job.id, type(e).__name__, e, exc_info=e)
                    self._fail([req], e)
        finally:
            self._flush(None)
        self.metrics.batch_size.set(len(self.decoder))

    def _flush(self, outbox: Optional[List[tuple]]) -> None:
        """Send the chunks gathered so far together; gather into ``outbox`` next (None: send at once)."""
        outbox, self._outbox = self._outbox, outbox
        push_together(outbox)

    def _emit(self, req: _Request, result: StepResult) -> None:
        """Hand one step's text to the request; at its end, count and release it."""
        stats, last = req.joining.stats, result.finish_reason is not None
        req.reply += result.tokens
        text = req.text.add(result.tokens, last)
        u = usage(stats) if last else None
        self._send(req.job, Chunk(text, result.finish_reason, u))
        if last:
            self._requests.pop(req.job.id, None)
            log.info("request %s: %d prompt tokens (%d reused), %d generated, %s, %.1f tokens/s (batched)",
                     req.job.id, len(req.job.spec.ids), req.joining.reused, stats.generation_tokens,
                     stats.tau_text() or "no drafter", stats.generation_tps)
            self._count(req.job, stats, "completed", req.joining.reused)
            self._end(req, True)
            self._release(req.job)

    def _fail(self, requests: List[_Request], error: BaseException) -> None:
        """End ``requests`` with an error (a 500, or an error event in a stream), counted and released."""
        self._detach(requests)
        for req in requests:
            self._end(req, False)
            self._send(req.job, Chunk(error=f"generation failed: {type(error).__name__}: {error}"))
            self._count(req.job, None, "error")
            self._release(req.job)

    def _detach(self, requests: List[_Request]) -> None:
        for req in requests:
            self._requests.pop(req.job.id, None)
            if req.joining in self._joining:
                self._joining.remove(req.joining)
        self.decoder.remove([r.job.id for r in requests])

    def _release(self, job: Job) -> None:
        """The job is done (its end is sent); a second call does nothing."""
        with self._lock:
            if job not in self._jobs:
                return
            self._jobs.discard(job)
            self.metrics.queue.set(len(self._jobs))
        self._send(job, None)

    def _send(self, job: Job, chunk: Any) -> None:
        """Push ``chunk`` to ``job`` now, or with the step's other chunks (one wake-up of the event loop)."""
        if self._outbox is None:
            job.push(chunk)
        else:
            self._outbox.append((job, chunk))

    def _count(self, job: Job, stats, outcome: str, reused: Optional[int] = None) -> None:
        """Count a request's outcome and generation (``reused``: prompt tokens found in the caches)."""
        self.metrics.request(job.endpoint, outcome)
        if stats is not None:
            self.metrics.generation(stats, len(job.spec.ids), reused or 0, time.perf_counter() - job.submitted)

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking jobs; running ones stop after their step, waiting ones at once. ``wait``: for the worker."""
        with self._lock:
            self.closing = True
            for job in self._jobs:
                job.close()
        with self._wake:
            self._wake.notify()
        if wait:
            self._worker.join()


def follow(pair: Any, block_size: Any, prefill_step_size: Optional[int], prompt_lookup: bool = False) -> None:
    """Ranks other than 0: run rank 0's jobs on ``pair`` (decoding as it does) until rank 0's server stops."""
    Engine(pair, block_size=block_size, prefill_step_size=prefill_step_size,
           prompt_lookup=prompt_lookup).shutdown(wait=True)
