"""The prompt cache for requests of a batch (``dflash serve --max-batch N``): a joining request resumes from the longest
stored prefix of its prompt and stores its prompt (or its boundaries, where caches cannot trim back)."""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .pair import trim_cache
from .entry import restore_or_warn, take_snapshot
from .key import key_id, pair_key
from .resume import boundaries, boundary_interval, trims_anywhere
from .store import PrefixStore


def prefix_not_batchable(drafter: Optional[Any], batched_drafter: bool) -> Optional[str]:
    """Why batched requests cannot use the prompt cache with ``drafter`` (None: plain decoding), or None;
    ``batched_drafter``: it drafts the batch in one pass."""
    if drafter is None:
        return None
    if not batched_drafter:
        return "the drafter has no batched pass (it drafts sequence by sequence)"
    if not trims_anywhere(drafter.make_cache()):
        kinds = sorted({type(c).__name__ for c in drafter.make_cache()})
        return f"the drafter's context caches cannot be trimmed to any row count ({', '.join(kinds)})"
    return None


@dataclass
class Resumed:
    """One request's solo caches (``draft_cache`` None without a drafter), ``rows`` prompt tokens each,
    reused from ``level`` (``"memory"``, ``"disk"``, or None)."""

    rows: int
    cache: List[Any]
    draft_cache: Optional[List[Any]]
    level: Optional[str] = None


class BatchPrefix:
    """Looks up, restores and keeps prompt-cache entries for the requests of a batch (target caches made
    with ``block_size``). ``at_boundaries``: the target's caches cannot go back; states are kept at :meth:`stops`."""

    def __init__(self, store: PrefixStore, target: Any, drafter: Optional[Any], block_size: int):
        self.store, self.target, self.drafter, self.block_size = store, target, drafter, block_size
        self.at_boundaries = not trims_anywhere(target.make_cache(block_size))
        self._key: Optional[Tuple[dict, str]] = None

    def stops(self, start: int, prompt_len: int, step: int) -> List[int]:
        """Row counts where a prompt prefilled from ``start`` in chunks of ``step`` stores states (none where
        caches trim anywhere)."""
        return boundaries(start, prompt_len, boundary_interval(step)) if self.at_boundaries else []

    def key(self) -> Tuple[dict, str]:
        """``(key dict, key id)`` of the pair (computed once: it hashes the weights)."""
        if self._key is None:
            key = pair_key(self.target, self.drafter)
            self._key = (key, key_id(key))
        return self._key

    def fresh(self) -> Resumed:
        """Empty solo caches (0 rows)."""
        draft_cache = self.drafter.make_cache() if self.drafter is not None else None
        return Resumed(0, self.target.make_cache(self.block_size), draft_cache)

    def resume(self, ids: Sequence[int]) -> Resumed:
        """Solo caches holding the longest stored prefix of prompt ``ids`` (all but its last token at most);
        fresh ones when nothing matches or fits."""
        found = self.store.lookup(self.key()[1], ids)
        if found is None:
            return self.fresh()
        snap, rows = found
        out = self.fresh()
        if not restore_or_warn(snap, out.cache, out.draft_cache, self.store.warn):
            return self.fresh()
        sides = [out.cache] + ([out.draft_cache] if out.draft_cache is not None else [])
        if not all(trim_cache(c, rows) for c in sides):  # cannot happen where every layer trims anywhere
            return self.fresh()
        out.rows, out.level = rows, self.store.last_level
        return out

    def keep(self, tokens: Sequence[int], cache: List[Any], draft_cache: Optional[List[Any]]) -> None:
        """Store an entry of ``tokens`` from solo caches of ``len(tokens)`` rows (nothing for another count)."""
        if (snap := take_snapshot(tokens, cache, draft_cache)) is not None:
            key, kid = self.key()
            self.store.put(kid, snap, key)
