"""A sequence's prompt prefilled before it joins the batch (:mod:`dflash_mlx.decode.batch`): one
chunk per :meth:`Joining.advance`, resumed from and stored to the prompt cache where there is one;
when the prompt is done it samples the first token and joins (``BatchDecoder.add``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import mlx.core as mx

from .acceptance import choose_rule
from .stopping import StopCondition
from ..prompt_cache.batch import extend, keep_rows
from ..prompt_cache.resume import PrefillStopped
from ..protocol import attention_of
from ..sampling import Sampler, next_key
from ..stats import GenerationStats

if TYPE_CHECKING:
    from .batch import BatchDecoder

NO_DRAFTER = "no drafter was given (--draft-model)"

BATCHED = "continuous batching verifies chains of the block size (no trees)"
BATCHED_AUTO = ("continuous batching: auto chooses a plain step or one chain width per step for the whole batch "
                "(no trees)")


@dataclass
class StepResult:
    """What one step committed for one sequence, and what ran: ``tokens`` (a stop token excluded, a stop
    string's tokens included), ``accepted`` drafts (None for the first token and plain steps),
    ``finish_reason`` ("stop", "length" or None), ``error`` (this sequence failed and left);
    ``features``: where a decoder with ``capture`` and no drafter saw the sequence finish, the context
    features [1, S, K*H] of every token it fed the target (the prompt and all emitted but the last);
    ``source``: what drafted (``chain``: the drafter, ``lookup``: prompt lookup, ``tree``), ``plain`` (nothing),
    None for the first token; ``width``: tokens the verify fed (a tree: its nodes), ``drafted`` of them;
    ``seconds``: the step's time (the whole batch's); ``probe``: auto ran it to measure it; ``stats``: the
    sequence's :class:`GenerationStats`, live (None in a failure's result)."""

    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    features: Optional[mx.array] = None
    source: Optional[str] = None
    width: int = 1
    drafted: int = 0
    seconds: float = 0.0
    probe: bool = False
    stats: Optional[GenerationStats] = None


class Joining:
    """A sequence being prefilled before it joins the batch, ``step_size`` tokens of ``prompt`` ([P] int32, P >= 1)
    per :meth:`advance`. ``cache``, ``draft_cache``: the sequence's own, where the decoder runs in
    :class:`OwnCaches` (else made here); ``stats``: filled in (else made here); ``history``: the ids that ``cache``
    holds before ``prompt`` (prompt lookup copies from them too). ``reused``: prompt tokens found in the prompt
    cache; ``source``: "memory", "disk" or None."""

    def __init__(self, decoder: "BatchDecoder", key: Any, prompt: mx.array, sampler: Optional[Sampler],
                 stop: StopCondition, step_size: int = 2048, should_stop: Optional[Callable[[], bool]] = None,
                 seed: Optional[int] = None, cache: Optional[List[Any]] = None, draft_cache: Optional[List[Any]] = None,
                 stats: Optional[GenerationStats] = None, history: Sequence[int] = ()):
        self.decoder, self.key, self.stop, self.history = decoder, key, stop, list(history)
        self.started = time.perf_counter()
        self.rng = None if seed is None else mx.random.key(seed)  # the sequence's own PRNG key
        self.rule = choose_rule(decoder.drafter, sampler)
        self.prompt, self.rest, self.step_size, self.should_stop = prompt, prompt, max(1, step_size), should_stop
        rows = decoder.rows
        self.cache = cache if cache is not None else decoder.target.make_cache(rows)
        self.draft_cache = draft_cache
        self.reused, self.source, self._looked_up = 0, None, decoder.prefix is None
        self._stops: List[int] = []  # prompt rows where states are stored (caches that cannot go back)
        self.features: List[mx.array] = []
        self.stats = stats if stats is not None else GenerationStats(decoder.width)  # the one place stats are made
        self._describe(int(prompt.size), seed is not None)

    def _describe(self, prompt_tokens: int, seeded: bool) -> None:
        """What this generation runs, in its stats: sizes, bytes, drafter, acceptance rule, verify."""
        stats, decoder, drafter = self.stats, self.decoder, self.decoder.drafter
        stats.block_size, stats.prompt_tokens, stats.speculative = decoder.width, prompt_tokens, drafter is not None
        stats.target_bytes, stats.drafter_bytes = decoder.bytes
        stats.drafter_format = getattr(drafter, "drafter_format", None)
        stats.reason = NO_DRAFTER if drafter is None else None
        if drafter is None:
            return
        stats.acceptance_rule, stats.verify = self.rule.name, dict(decoder.chooser.verify or {}) or None  # a copy
        if decoder.caches.batched:
            auto = decoder.chooser.fixed is None and not seeded
            stats.verify = {"block_size": "auto" if auto else decoder.width, "tree_budget": None,
                            "reason": BATCHED_AUTO if auto else BATCHED}

    def advance(self) -> Optional[StepResult]:
        """Prefill one chunk; None while chunks remain. Then sample the first token and join the batch
        (unless its ``finish_reason`` is set) and return its :class:`StepResult`. A failed prompt-cache
        write is a warning; anything else raised leaves the batch as it was (``decoder.remove([key])``
        takes out a sequence that had joined). Raises PrefillStopped where ``should_stop()`` is true."""
        if self.should_stop is not None and self.should_stop():
            raise PrefillStopped()
        if not self._looked_up:
            self._resume()
        target, capture = self.decoder.target, self.decoder.capture
        done = int(self.prompt.size - self.rest.size)
        n = min(self.step_size, int(self.rest.size))
        if self._stops:
            n = min(n, self._stops[0] - done)  # chunks end at the boundaries
        last = n == self.rest.size
        chunk = self.rest[:n]
        h, f = target(chunk[None], self.cache, capture)
        self.rest = self.rest[n:]
        if f is not None:
            self.features.append(f)
        if not last:
            mx.eval([c.state for c in self.cache], self.features)
            if self._stops and self._stops[0] == done + n:
                self._store(self._keep_state, self._stops.pop(0))
            return None
        self.rng, key = next_key(self.rng)
        t = self.rule.choose(target.lm_head(h[:, -1]), key)
        mx.eval(t)
        tokens, finish = self.stop.cut(t.tolist())
        now = time.perf_counter()
        self.stats.prompt_s = self.stats.phase_s["prefill"] = now - self.started
        self.stats.committed(len(tokens), now, now, attention_of(self.decoder.drafter))
        context = [context_rows(self.features)] if self.features else []  # empty without a drafter
        if finish is None:
            self.decoder.add(self, t, context, now)
        else:
            self.decoder.caches.ended(self, tokens, context)
        if self.decoder.prefix is not None and not self.decoder.prefix.at_boundaries:
            self._store(self._keep, context, finish is None)
        self.cache, self.draft_cache, self.features = None, None, []  # the batch holds copies: free these
        kept = context[0] if finish is not None and context and self.decoder.drafter is None else None
        return StepResult(tokens, None, finish, features=kept, stats=self.stats)

    def _resume(self) -> None:
        """Restore the longest stored prefix of the prompt into fresh caches; only the rest is prefilled."""
        self._looked_up = True
        found = self.decoder.prefix.resume(self.prompt.tolist())
        self.cache, self.draft_cache = found.cache, found.draft_cache
        self.reused, self.source = found.rows, found.level
        self.rest = self.prompt[found.rows:]
        self.stats.prompt_reused = found.rows
        self._stops = self.decoder.prefix.stops(found.rows, int(self.prompt.size), self.step_size)

    def _store(self, keep: Callable[..., None], *args: Any) -> None:
        """Run ``keep`` (a prompt-cache write); any failure is one warning and the sequence goes on."""
        try:
            keep(*args)
        except Exception as e:  # a write that fails costs a cache entry, never the request
            self.decoder.prefix.store.warn(f"prompt cache: an entry was not stored ({type(e).__name__}: {e})")

    def _keep_state(self, rows: int) -> None:
        """Store both caches at a boundary of ``rows`` prompt rows (the drafter ingests its rows first)."""
        if self.draft_cache is not None and self.features:
            self.decoder.drafter.ingest(context_rows(self.features), self.draft_cache)
            self.features = []
        self.decoder.prefix.keep(self.prompt[:rows].tolist(), self.cache, self.draft_cache)

    def _keep(self, context: List[mx.array], joined: bool) -> None:
        """Store the prompt's entry from the sequence's own caches (a batch copied them; both hold every prompt row)."""
        if not joined and self.draft_cache is not None and context:
            self.decoder.drafter.ingest(context[0], self.draft_cache)
        self.decoder.prefix.keep(self.prompt.tolist(), self.cache, self.draft_cache)


def context_rows(rows: List[mx.array]) -> Optional[mx.array]:
    """Context feature rows ([1, S_i, F] each) as one [1, S, F] array."""
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=1)


def rollback_to(target: TargetAdapter, cache: List[Any], rows: int, drafter: Optional[Drafter] = None,
                draft_cache: Optional[List[Any]] = None, new_context: Sequence[mx.array] = ()) -> None:
    """Trim the target cache to ``rows``, then give the drafter the context rows it lacks
    (``new_context`` starts at its offset), so both caches cover the same tokens."""
    target.rollback(cache, cache[0].offset - rows)
    if drafter is not None and draft_cache is not None and new_context:
        missing = cache[0].offset - draft_cache[0].offset
        if missing > 0:
            drafter.ingest(context_rows(list(new_context))[:, :missing], draft_cache)


class OwnCaches:
    """Where one sequence at a time decodes: its own caches (the target's, resumed from the prompt cache or fresh,
    and its drafter's; trees verify there). When it leaves, they keep every committed token but the last, so the
    next request resumes from them (:class:`~dflash_mlx.prompt_cache.pair.PairCache`)."""

    batched = False

    def join(self, cache: Optional[List[Any]], joining: "Joining") -> List[Any]:
        """The caches a sequence decodes in: ``joining``'s own (``cache`` is None: nothing else decodes)."""
        self.base = joining.cache[0].offset if joining.cache else 0  # rows before its first token
        return joining.cache

    def leave(self, decoder: "BatchDecoder", rows: Sequence[int]) -> Optional[List[Any]]:
        """The caches after the sequence left (``rows`` empty): None, its own rolled back to its committed rows."""
        s = decoder.sequences[0]
        rollback_to(decoder.target, decoder.cache, self.base + s.stop.emitted - 1, decoder.drafter, s.draft_cache,
                    s.new_context)

    def ended(self, joining: "Joining", tokens: Sequence[int], context: List[mx.array]) -> None:
        """A sequence that ended at its first token (``tokens``) rolls its caches back as :meth:`leave` does."""
        rollback_to(joining.decoder.target, joining.cache, joining.cache[0].offset + len(tokens) - 1,
                    joining.decoder.drafter, joining.draft_cache, context)


class BatchedCaches:
    """Where N sequences decode together: one left-padded batched cache per target layer, a row per sequence in
    order (:mod:`dflash_mlx.prompt_cache.batch`); a leaving sequence's row is dropped."""

    batched = True

    def join(self, cache: Optional[List[Any]], joining: "Joining") -> List[Any]:
        """``cache`` with ``joining``'s prefilled caches appended as its last row."""
        return extend(cache, joining.cache)

    def leave(self, decoder: "BatchDecoder", rows: Sequence[int]) -> Optional[List[Any]]:
        """``decoder``'s cache with only the sequences at ``rows``, in that order."""
        return keep_rows(decoder.cache, rows)

    def ended(self, joining: "Joining", tokens: Sequence[int], context: List[mx.array]) -> None:
        """Nothing: a sequence that ended at its first token never joined."""
