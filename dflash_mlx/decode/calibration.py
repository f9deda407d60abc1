"""Where the cost model's seconds come from, and what it keeps between processes.

``--block-size auto`` chooses widths by seconds per step. Those seconds come from a
:class:`Timings` source, injected into the policy:

- :class:`MeasuredTimings` (the default): this machine's clock. A target forward of
  each width and a drafter pass are timed once on scratch caches
  (:func:`calibrate`), then every real step reports its wall time.
- :class:`FixedTimings`: seconds given up front, the same for every step of a mode
  and width whatever the clock says. Tests use it, so what they check never depends
  on how busy the machine is; simulations use it to replay a known cost.

A :class:`~dflash_mlx.decode.calibration_store.CalibrationStore` keeps those seconds
between processes (:mod:`dflash_mlx.decode.calibration_store`; its names are importable
from here too).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple

import mlx.core as mx

from ..fingerprint import folder_fingerprint  # noqa: F401 (its old place)
from .calibration_store import (  # noqa: F401 (the store's names, importable from here as before)
    CACHE_ENV, STORE_FORMAT, CalibrationStore, cache_root, device_name, store_key)

TIMED_ROUNDS = 5  # timed rounds, each timing every forward, draft and step once (after rounds unseen)
PLAIN_TIMED_STEPS = 8  # plain steps in a timed run (a plain step is timed pipelined, as the loop runs it)


CONTEXTS = (32, 256)  # context rows the forwards are timed at (cost grows with the context)


@dataclass
class Calibration:
    """Seconds of the steps and their pieces, timed (or given) before decoding, at two
    context lengths: a wide verify's attention grows with the context, and on a CPU
    that decides between widths.

    Attributes:
        verify_s: ``{n: (seconds at contexts[0], seconds at contexts[1])}`` of a
            target forward of n tokens (features and logits included); n = 1 is a
            plain decoding step.
        draft_s: ``{D: (seconds, seconds)}`` of one drafter pass drafting a block of D.
        chain_s: ``{n: (seconds, seconds)}`` of a whole step as the decode loop runs
            it: n = 1, a plain step in a pipelined run (each queued before the last is
            read); n >= 2, a chain step of width n, drafted at the smallest timed
            block that holds n, the verify built on the drafts while the drafter runs
            (its overlap makes a step cheaper than its draft and forward timed apart).
        contexts: the two context lengths, in tokens.
    """

    verify_s: Dict[int, Tuple[float, float]]
    draft_s: Dict[int, Tuple[float, float]]
    chain_s: Dict[int, Tuple[float, float]]
    contexts: Tuple[int, int] = CONTEXTS

    def forward(self, n: int, context: int) -> float:
        """Seconds of a target forward of ``n`` tokens after ``context`` tokens."""
        return _lookup(self.verify_s, n, context, self.contexts)

    def draft(self, block: int, context: int) -> float:
        """Seconds of a drafter pass drafting ``block`` tokens after ``context`` tokens."""
        return _lookup(self.draft_s, block, context, self.contexts)

    def chain(self, n: int, context: int) -> float:
        """Seconds of a chain step of width ``n`` after ``context`` tokens."""
        return _lookup(self.chain_s, n, context, self.contexts)

    def capped(self) -> "Calibration":
        """The same, with a wider forward, draft or step never cheaper than a narrower
        one (a slow outlier of a busy machine is capped by the wider timings), and a
        wider chain step never cheaper than the narrower one plus the extra forward
        and drafting, timed apart (the verify waits for its drafts, so their device
        times add up; one fast outlier made chains of 16 cost what chains of 8 did)."""
        verify, draft = _monotone(self.verify_s), _monotone(self.draft_s)
        return Calibration(verify, draft, _additive(_monotone(self.chain_s), verify, draft), self.contexts)

    def to_dict(self) -> dict:
        return {name: {str(n): list(t) for n, t in getattr(self, name).items()} for name in _TABLES} | {
            "contexts": list(self.contexts)}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """The inverse of :meth:`to_dict`.

        Raises:
            ValueError: a missing key, or a value that is not a finite number > 0.
        """
        try:
            tables = [{int(n): (float(t[0]), float(t[1])) for n, t in d[name].items()} for name in _TABLES]
            contexts = (int(d["contexts"][0]), int(d["contexts"][1]))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"not a calibration ({e})") from None
        values = [x for table in tables for t in table.values() for x in t]
        if not all(tables) or not all(math.isfinite(x) and x > 0 for x in values) \
                or not 0 <= contexts[0] < contexts[1]:
            raise ValueError("not a calibration (a time that is not a finite number > 0, or bad contexts)")
        return cls(*tables, contexts)


_TABLES = ("verify_s", "draft_s", "chain_s")


def _lookup(table: Dict[int, Tuple[float, float]], n: int, context: int, contexts: Tuple[int, int]) -> float:
    """Piecewise linear in n between timed sizes (flat past the ends: a size past
    the largest is never asked for), linear in the context (extended past both)."""
    keys = sorted(table)
    n = min(max(n, keys[0]), keys[-1])
    hi = next(k for k in keys if k >= n)
    lo = max([k for k in keys if k <= n])
    w = 0.0 if hi == lo else (n - lo) / (hi - lo)
    t0 = (1 - w) * table[lo][0] + w * table[hi][0]
    t1 = (1 - w) * table[lo][1] + w * table[hi][1]
    c0, c1 = contexts
    t = t0 + (t1 - t0) * (context - c0) / (c1 - c0)
    return max(t, 0.5 * min(t0, t1))


def _additive(chain: Dict[int, Tuple[float, float]], verify: Dict[int, Tuple[float, float]],
              draft: Dict[int, Tuple[float, float]]) -> Dict[int, Tuple[float, float]]:
    out, last = dict(chain), None
    for n in sorted(k for k in chain if k >= 2):
        if last is not None and n in verify and last in verify and draft:
            b, a = chain_block(n, list(draft)), chain_block(last, list(draft))
            out[n] = tuple(max(out[n][j], out[last][j] + max(draft[b][j] - draft[a][j], 0.0)
                               + max(verify[n][j] - verify[last][j], 0.0)) for j in (0, 1))
        last = n
    return out


def _monotone(table: Dict[int, Tuple[float, float]]) -> Dict[int, Tuple[float, float]]:
    keys = sorted(table)
    return {n: tuple(min(table[m][j] for m in keys[i:]) for j in (0, 1)) for i, n in enumerate(keys)}


class Timings(Protocol):
    """A source of seconds for the cost model (see the module doc).

    Attributes:
        measured: whether the seconds are this machine's (then worth keeping).
        store: a :class:`CalibrationStore` keeping calibrations between processes, or None.
    """

    measured: bool
    store: Optional["CalibrationStore"]

    def calibrate(self, target, drafter, widths: Sequence[int], blocks: Sequence[int]) -> Calibration:
        """Seconds of a forward of each width in ``widths`` and of a drafter pass at
        each block size in ``blocks``."""

    def step(self, mode: str, width: int, wall_s: float, block: Optional[int] = None) -> float:
        """The seconds a real step of ``mode`` feeding ``width`` tokens, drafted at
        ``block`` (None: nothing drafted), counts for, given its measured ``wall_s``."""

    def overhead(self, wall_s: float) -> float:
        """The seconds a step's work outside drafting and verifying (planning,
        bookkeeping) counts for, given its measured ``wall_s``."""


class MeasuredTimings:
    """This machine's clock: :func:`calibrate`, then each step's wall time.

    Args:
        store: where calibrations are kept between processes (default: a
            :class:`CalibrationStore` in the user's cache folder).
    """

    measured = True

    def __init__(self, store: Optional["CalibrationStore"] = None):
        self._store = store

    @property
    def store(self) -> "CalibrationStore":
        return self._store if self._store is not None else CalibrationStore()

    def calibrate(self, target, drafter, widths: Sequence[int], blocks: Sequence[int]) -> Calibration:
        return calibrate(target, drafter, widths, blocks)

    def step(self, mode: str, width: int, wall_s: float, block: Optional[int] = None) -> float:
        return wall_s

    def overhead(self, wall_s: float) -> float:
        return wall_s


class FixedTimings:
    """Seconds fixed up front: a forward of n tokens takes ``forward_s(n)`` and a
    drafter pass drafting D tokens ``draft_s(D)`` at any context, and every step
    counts for exactly that (plain steps: the forward; chains: the forward plus a
    pass at the drafted block; trees: the forward plus a pass at the trained block),
    whatever its wall time.

    Args:
        forward_s: seconds of a target forward of n tokens (default 1 ms + 0.05 ms
            per token: wide verifies are cheap, as on a GPU).
        draft_s: seconds of a drafter pass, a number or a function of the block
            drafted (default 1 ms).
    """

    measured = False
    store = None  # fixed seconds are not worth keeping

    def __init__(self, forward_s: Optional[Callable[[int], float]] = None,
                 draft_s: float | Callable[[int], float] = 1e-3):
        self.forward_s = forward_s or (lambda n: 1e-3 + 5e-5 * n)
        self.draft_s = draft_s if callable(draft_s) else (lambda block, s=draft_s: s)

    def calibrate(self, target, drafter, widths: Sequence[int], blocks: Sequence[int]) -> Calibration:
        chains = {n: self.forward_s(n) + (self.draft_s(chain_block(n, blocks)) if n > 1 else 0.0)
                  for n in widths if n <= max(blocks)}
        return Calibration({n: (self.forward_s(n),) * 2 for n in widths}, {b: (self.draft_s(b),) * 2 for b in blocks},
                           {n: (t, t) for n, t in chains.items()})

    def step(self, mode: str, width: int, wall_s: float, block: Optional[int] = None) -> float:
        """Seconds of a step feeding ``width`` tokens after a drafter pass at ``block``
        (None: no pass, a plain step)."""
        return self.forward_s(width) + (0.0 if block is None else self.draft_s(block))

    def overhead(self, wall_s: float) -> float:
        """A step's seconds outside drafting and verifying: none."""
        return 0.0


def calibrate(target, drafter, widths: Sequence[int], blocks: Sequence[int],
              contexts: Tuple[int, int] = CONTEXTS) -> Calibration:
    """Time the target's forward at each width and a drafter pass at each block size,
    after each of two context lengths, on scratch caches (the real caches are never
    touched): each the median of :data:`TIMED_ROUNDS` interleaved rounds, after a
    warm-up round (:func:`_interleaved`).

    Args:
        target: a :class:`~dflash_mlx.targets.TargetAdapter`.
        drafter: a bound drafter.
        widths: tokens per target forward to time (1 = a plain step).
        blocks: block sizes to draft.
        contexts: context lengths in tokens (shortened to fit the target's context).

    Returns:
        The :class:`Calibration`, more tokens never costing less (:meth:`Calibration.capped`).
    """
    limit = getattr(target.args, "max_position_embeddings", None) or 1 << 30
    room = limit - max(*widths, *blocks) - 2
    contexts = (min(contexts[0], room // 2), min(contexts[1], room))
    V = target.vocab_size
    token = mx.array([1], dtype=mx.int32)
    layer_ids = drafter.target_layer_ids
    verify: Dict[int, list] = {n: [] for n in widths}
    draft: Dict[int, list] = {b: [] for b in blocks}
    chain: Dict[int, list] = {n: [] for n in widths if n <= max(blocks)}
    for i, context in enumerate(contexts):
        cache = target.make_cache(max(widths))
        _, features = target((mx.arange(context + 1, dtype=mx.int32) % V)[None], cache, layer_ids)
        mx.eval([c.state for c in cache], features)
        runs = [(verify[n], lambda: None, lambda n=n: _forward(target, cache, layer_ids, n)) for n in sorted(verify)]
        runs += [(draft[b], lambda: _scratch_drafter_cache(drafter, features),
                  lambda c, b=b: mx.eval(drafter.draft(token, features[:, -1:], c, b))) for b in sorted(draft)]
        runs += [(chain[1], lambda: None, lambda: _plain_run(target, cache, layer_ids))]
        runs += [(chain[n], lambda: _scratch_drafter_cache(drafter, features),
                  lambda c, n=n: _chain(target, cache, drafter, c, token, features, n, chain_block(n, blocks)))
                 for n in sorted(chain)[1:]]
        times = _interleaved(runs, warm=2 if i == 0 else 1)  # a process's first forwards run slow: rounds unseen
        for (table, _, _), t in zip(runs, times):
            table.append(t / (PLAIN_TIMED_STEPS if table is chain[1] else 1))
    tables = []
    for table in (verify, draft, chain):  # a cost does not fall as the context grows: the lower one is the truer
        tables.append({key: (min(t0, t1), t1) for key, (t0, t1) in table.items()})
    return Calibration(*tables, contexts).capped()


def chain_block(width: int, blocks: Sequence[int]) -> int:
    """The block a chain of ``width`` is drafted at: the smallest of ``blocks`` >= width."""
    return min([b for b in blocks if b >= width] or [max(blocks)])


def _forward(target, cache, layer_ids, n: int) -> None:
    h, f = target(mx.full((1, n), 1, dtype=mx.int32), cache, layer_ids)
    mx.eval(target.lm_head(h), f)
    target.rollback(cache, n)


def _scratch_drafter_cache(drafter, features: mx.array):
    """A drafter cache holding every context row but the last, as mid-generation (a
    fresh one per run: drafter caches do not all roll back; filling it is not timed)."""
    cache = drafter.make_cache()
    drafter.ingest(features[:, :-1], cache)
    mx.eval([c.state for c in cache])
    return cache


def _plain_run(target, cache, layer_ids, steps: int = PLAIN_TIMED_STEPS) -> float:
    """A run of plain steps as the loop runs it (each queued before the last is read,
    capturing features)."""
    from .batch import plain_step  # the loop's own step

    pick = lambda logits: mx.argmax(logits, axis=-1).astype(mx.int32)  # noqa: E731
    y, f = plain_step(target, cache, layer_ids, pick, mx.array([1], dtype=mx.int32))
    for i in range(steps):
        queued = plain_step(target, cache, layer_ids, pick, y) if i + 1 < steps else None
        if queued is not None:
            mx.async_eval(*queued)
        mx.eval(y, f)
        y.tolist()
        if queued is not None:
            y, f = queued
    target.rollback(cache, steps)


def _chain(target, cache, drafter, draft_cache, token: mx.array, features: mx.array, width: int, block: int) -> None:
    """One chain step as the loop runs it: the draft dispatched, the verify built on it."""
    drafts = drafter.draft(token, features[:, -1:], draft_cache, block)
    mx.async_eval(drafts)
    h, f = target(mx.concatenate([token, drafts[: width - 1]])[None], cache, drafter.target_layer_ids)
    mx.eval(mx.argmax(target.lm_head(h), axis=-1), f)
    target.rollback(cache, width)


def _interleaved(runs, warm: int) -> list:
    """Seconds of each ``(table, setup, run)`` in ``runs``: the median of
    :data:`TIMED_ROUNDS` rounds that each time every run once, after ``warm`` rounds
    unseen. ``setup`` (untimed) makes ``run``'s argument, or None for none.

    Interleaved, a slow spell of a shared machine falls on every width alike, so
    it does not tilt the choice between them; the median is what a typical step
    costs (the fastest run of each width, taken one width after another, let a
    lucky run of one width make it look up to half again cheaper than the others)."""
    times = [[] for _ in runs]
    for r in range(warm + TIMED_ROUNDS):
        for out, (_, setup, run) in zip(times, runs):
            arg = setup()
            tic = time.perf_counter()
            run() if arg is None else run(arg)
            if r >= warm:
                out.append(time.perf_counter() - tic)
    return [statistics.median(t) for t in times]
