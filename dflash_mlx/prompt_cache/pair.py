"""Both caches of a pair kept between generations, and the token ids their rows hold (row i is token i);
a generation resumes from the longest common prefix (live or stored) and prefills only the rest."""

import time
from os.path import commonprefix
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence

from mlx_lm.models.cache import KVCache

from ..protocol import MAX_COPY
from .rollback import can_trim, rollback
from .entry import Snapshot, restore_or_warn, take_snapshot
from .key import key_id, pair_key
from .resume import boundaries, boundary_interval, prefill_to, trims_anywhere
from .store import PrefixStore


def common_prefix(a: Sequence[int], b: Sequence[int], limit: Optional[int] = None) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    return len(commonprefix([list(a[:limit]), list(b)]))


def trim_cache(cache: List[Any], rows: int) -> bool:
    """Trim every layer of ``cache`` to ``rows`` tokens; False, with nothing trimmed, when a layer cannot
    drop its rows exactly.

    Raises:
        RollbackError: a layer trimmed another count than asked (a cache bug)."""
    counts = [c.offset - rows for c in cache]
    if not all(map(can_trim, cache, counts)):
        return False
    rollback(cache, counts)
    for c in cache:  # an interrupted ``update_and_fetch`` can leave keys and values uneven: both cut to the offset
        if isinstance(c, KVCache) and c.keys is not None and c.keys.shape[2] != c.values.shape[2]:
            c.keys, c.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    return True


class PairCache:
    """The target's and the drafter's caches, reused across generations.

    Args:
        target: the target adapter.
        tokenizer: mlx-lm ``TokenizerWrapper``.
        drafter: a bound drafter, or None for plain decoding.
        store: a :class:`~dflash_mlx.prompt_cache.store.PrefixStore` (None: the live caches only).
        interval: prompt tokens between stored states where caches cannot trim back (default
            :data:`~dflash_mlx.prompt_cache.resume.DEFAULT_INTERVAL`).
        generate: the decode loop :meth:`stream` runs (``stream_generate``, passed by callers above decode).

    Attributes:
        tokens: ids both caches hold. cache, draft_cache: the caches (``draft_cache`` None without a drafter).
        last_reused: prompt tokens the last generation reused; last_source: ``"live"``, ``"memory"``,
            ``"disk"`` or None."""

    def __init__(self, target: Any, tokenizer: Any, drafter: Optional[Any] = None, store: Optional[PrefixStore] = None,
                 interval: Optional[int] = None, generate: Optional[Callable[..., Generator]] = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.store, self.interval, self.generate = store, interval, generate
        self.tokens: List[int] = []
        self.last_reused = 0
        self.last_source: Optional[str] = None
        self._key: Optional[tuple] = None  # (target, drafter, key dict, key id)
        self._auto: Optional[tuple] = None  # (target, drafter, what auto learned: WidthChooser.state)
        self._unsaved: List[Snapshot] = []
        self.cache, self.draft_cache = self._new_caches()

    def reuse(self, ids: Sequence[int]) -> int:
        """Trim both caches to the common prefix of ``tokens`` and all but the last of ``ids``;
        returns the rows kept (0 with fresh caches where a layer cannot trim exactly)."""
        self.settle(self.tokens, len(self.tokens))  # safety net after a double interrupt
        self.settle(ids, common_prefix(self.tokens, ids, len(ids) - 1))
        return len(self.tokens)

    def settle(self, ids: Sequence[int], rows: int) -> None:
        """Trim both caches to the first ``rows`` of ``ids`` (fewer where a layer holds fewer; fresh caches
        where one cannot go back exactly); ``tokens`` says what is kept."""
        keep = min([rows] + [c.offset for cache in self._caches() for c in cache])
        if not all(trim_cache(cache, keep) for cache in self._caches()):
            self.cache, self.draft_cache = self._new_caches()  # cannot go back exactly: prefill everything again
            keep = 0
        self.tokens = list(ids[:keep])

    def reset(self) -> None:
        """Trim both caches to 0 rows."""
        self.settle([], 0)

    def begin(self, ids: Sequence[int], step: int = 2048, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Before a generation: reuse what the caches or the store hold of ``ids`` and prefill to its
        boundaries; returns the rows both caches hold (feed ``ids`` from there).

        Raises:
            PrefillStopped: ``should_stop()`` was true between two chunks."""
        self._unsaved = []
        reused = self.last_reused = self.reuse(ids)
        self.last_source = "live" if reused else None
        if self.store is not None:
            reused = self.last_reused = self._resume(list(ids), reused)
        return self._prefill_boundaries(list(ids), reused, step, should_stop)

    def end(self, ids: Sequence[int], known: int, done: bool) -> None:
        """After a generation: keep the first ``known`` rows of ``ids`` (prompt and reply); store them if ``done``."""
        self.settle(ids, known)
        if done:
            self._keep()

    def stream(self, ids: Sequence[int], **kwargs) -> Generator:
        """Generate from ``ids`` with ``generate`` (``kwargs`` go to it); closed early, keep the complete rows."""
        if self.generate is None:
            raise TypeError("PairCache.stream needs generate= (the decode loop)")
        ids, tic, reply, done, first = list(ids), time.perf_counter(), [], False, True
        known = reused = self.reuse(ids)
        try:
            known = start = self.begin(ids, int(kwargs.get("prefill_step_size") or 2048), kwargs.get("should_stop"))
            reused, pre_s = self.last_reused, time.perf_counter() - tic
            cached = {"cached_ids": ids[:start]} if kwargs.get("prompt_lookup") else {}
            if self.drafter is not None:  # what auto learned for this pair: read once from the store, then kept
                if self._auto is None or self._auto[0] is not self.target or self._auto[1] is not self.drafter:
                    learned = self.store.auto_state(self.pair_key()[1]) if self.store is not None else {}
                    self._auto = (self.target, self.drafter, learned)
                cached["auto_state"] = self._auto[2]
            for r in self.generate(self.target, self.tokenizer, ids[start:], self.drafter,
                                   prompt_cache=self.cache, draft_cache=self.draft_cache, **cached, **kwargs):
                if first:  # rows reused and time spent here count as the prompt's
                    r.stats.prompt_tokens, r.stats.prompt_reused = len(ids), reused
                    r.stats.prompt_s, first = r.stats.prompt_s + pre_s, False
                reply.extend(r.tokens)
                known = len(ids) + len(reply) - 1
                yield r
            done = True
            if self.store is not None and cached.get("auto_state"):
                self.store.put_auto_state(self.pair_key()[1], cached["auto_state"])
        finally:
            self.end(ids + reply, known, done)

    def pair_key(self) -> tuple:
        """``(key dict, key id)`` of the current target and drafter (computed once per pair)."""
        if self._key is None or self._key[0] is not self.target or self._key[1] is not self.drafter:
            key = pair_key(self.target, self.drafter)
            self._key = (self.target, self.drafter, key, key_id(key))
        return self._key[2], self._key[3]

    def _resume(self, ids: List[int], live: int) -> int:
        """Restore a stored entry holding more of ``ids`` than ``live`` rows, if any; returns the rows reused."""
        found = self.store.lookup(self.pair_key()[1], ids)
        if found is None or found[1] <= live:
            return live
        snap, rows = found
        cache, draft_cache = self._new_caches()
        if not restore_or_warn(snap, cache, draft_cache, self.store.warn):
            return live
        self.cache, self.draft_cache, self.tokens = cache, draft_cache, list(snap.tokens)
        self.settle(ids, rows)
        self.last_source = self.store.last_level
        return len(self.tokens)

    def _prefill_boundaries(self, ids: List[int], start: int, step: int, should_stop) -> int:
        """Where caches cannot trim back, prefill ``ids`` from ``start`` to its last boundary, keeping the
        state at each; returns the rows both caches hold."""
        if self.store is None or trims_anywhere(self.cache, self.draft_cache):
            return start
        stops = boundaries(start, len(ids), boundary_interval(step, self.interval))
        for b in prefill_to(self.target, self.drafter, self.cache, self.draft_cache, ids, start, stops,
                            step, should_stop):
            self.tokens = list(ids[:b])
            self._snapshot(defer=True)
        return len(self.tokens) if stops else start

    def _snapshot(self, defer: bool) -> None:
        """Keep the caches' state in memory, and on disk now or (``defer``) after the generation."""
        snap = take_snapshot(self.tokens, self.cache, self.draft_cache)
        if snap is None:
            return
        key, kid = self.pair_key()
        self.store.put(kid, snap, key, disk=not defer)
        if defer:
            self._unsaved.append(snap)

    def _keep(self) -> None:
        """After a generation: write the deferred states to disk, then the final one."""
        if self.store is None:
            return
        key, kid = self.pair_key()
        for snap in self._unsaved:
            self.store.put(kid, snap, key)
        self._unsaved = []
        if self.tokens:
            self._snapshot(defer=False)

    def _caches(self) -> List[List[Any]]:
        return [self.cache] + ([self.draft_cache] if self.draft_cache is not None else [])

    def _new_caches(self) -> tuple:
        B = max(self.drafter.block_size if self.drafter is not None else 1, MAX_COPY + 1)  # a copy's verify too
        return self.target.make_cache(B), (self.drafter.make_cache() if self.drafter is not None else None)

    def offsets(self) -> Dict[str, List[int]]:
        """Per-layer cache offsets: ``{"target": [...], "drafter": [...]}``."""
        out = {"target": [c.offset for c in self.cache]}
        if self.draft_cache is not None:
            out["drafter"] = [c.offset for c in self.draft_cache]
        return out

    def is_consistent(self) -> bool:
        """Every layer of both caches holds exactly ``len(tokens)`` rows."""
        return all(o == len(self.tokens) for v in self.offsets().values() for o in v)
