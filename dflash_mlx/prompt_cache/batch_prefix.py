"""The prompt cache for requests of a batch (``dflash serve --max-batch N``): a joining request
restores the longest stored prefix of its prompt (all but its last token) into fresh solo caches
and prefills the rest, then stores its prompt; where some target layer cannot go back (hybrids,
sliding windows), states at :func:`~dflash_mlx.prompt_cache.resume.boundaries` instead, each resuming a
prompt only at its exact row count. The drafter must draft the batch in one pass (or be absent)
with caches that trim anywhere; else :func:`batch_prefix_refusal` names the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .pair import trim_cache
from .entry import restore_or_warn, take_snapshot
from .key import key_id, pair_key
from .resume import boundaries, boundary_interval, trims_anywhere
from .store import PrefixStore


def batch_prefix_refusal(drafter: Optional[Any], batched_drafter: bool) -> Optional[str]:
    """Why batched requests cannot use the prompt cache with this drafter, or None when
    they can (every target can: see the module's notes).

    Args:
        drafter: the bound drafter, or None (plain decoding).
        batched_drafter: whether the drafter drafts the batch in one pass.
    """
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
    """Fresh solo caches of one request, filled from the store where it held a prefix.

    Attributes:
        rows: prompt tokens both caches hold (0..len(ids) - 1): the tokens reused.
        cache: the target's solo caches, one per layer, ``rows`` rows each.
        draft_cache: the drafter's solo context caches, ``rows`` rows each (None without a drafter).
        level: where the entry came from: ``"memory"``, ``"disk"``, or None (nothing reused).
    """

    rows: int
    cache: List[Any]
    draft_cache: Optional[List[Any]]
    level: Optional[str] = None


class BatchPrefix:
    """Looks up, restores and keeps prompt-cache entries for the requests of a batch.

    Args:
        store: the prompt cache.
        target: the target adapter.
        drafter: the bound drafter (see :func:`batch_prefix_refusal`), or None.
        block_size: B, as the batch makes the target's caches.

    Attributes:
        at_boundaries: the target's caches cannot go back (hybrid, sliding window):
            states are stored at :meth:`stops`, not once per prompt.
    """

    def __init__(self, store: PrefixStore, target: Any, drafter: Optional[Any], block_size: int):
        self.store, self.target, self.drafter, self.block_size = store, target, drafter, block_size
        self.at_boundaries = not trims_anywhere(target.make_cache(block_size))
        self._key: Optional[Tuple[dict, str]] = None

    def stops(self, start: int, prompt_len: int, step: int) -> List[int]:
        """Where a prompt of ``prompt_len`` tokens, prefilled from row ``start`` in chunks
        of ``step``, stores states (increasing row counts); none where caches trim anywhere
        (the whole prompt is stored once it is done)."""
        if not self.at_boundaries:
            return []
        return boundaries(start, prompt_len, boundary_interval(step))

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
        """Solo caches holding the longest stored prefix of ``ids`` (at most all but its last token).

        Args:
            ids: the whole prompt, token ids (at least one).

        Returns:
            Caches trimmed to the matched rows; fresh ones (rows 0) when nothing matches
            or the entry does not fit this pair (one warning through the store).
        """
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
        """Put an entry of ``tokens`` into the store (memory and disk) from the solo caches,
        which hold ``len(tokens)`` rows each; nothing when they hold another count."""
        snap = take_snapshot(tokens, cache, draft_cache)
        if snap is not None:
            key, kid = self.key()
            self.store.put(kid, snap, key)
