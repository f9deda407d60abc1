"""Which step the decode loop runs next: plain, a chain verify of some width, or a tree.

``--block-size auto`` (the CLI default) and ``--tree-budget auto`` let the cost model
(:mod:`dflash_mlx.decode.cost`) choose per step, from timings taken on this machine: plain
steps, chains of any width up to the drafted block, and (tree auto) trees of 8..64
nodes. A fixed ``--block-size B`` always verifies chains of B; a fixed
``--tree-budget N`` always verifies trees of N nodes, drafted at B.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .calibration import Calibration, CalibrationStore, MeasuredTimings, Timings, store_key
from .cost import CHAIN, PLAIN, TREE, CostModel
from ..errors import InputError
from ..ranges import check_number
from .tree import DraftTree, build_tree

AUTO = "auto"
TREE_BUDGETS = (8, 16, 32, 64)  # the budgets --tree-budget auto chooses among
REDECIDE = 4  # a chain width is re-chosen every this many steps
PLAIN_RUN = 64  # most plain steps run between two decisions: only probes and the context change the choice, and each run end breaks the pipeline
PLAIN_MARGIN = 0.1  # plain decoding is taken when its expected rate is this much better
PROBE_WIDTH = 4  # a probe drafts at least this many tokens' block
CLOSE = 0.15  # ... and while it is better by less than this, probes stay frequent


@dataclass
class Plan:
    """The next step: ``mode`` plain (width 1), chain (``width`` tokens) or tree
    (``width`` = budget N nodes); ``block``: the block drafted (chains: ``width``
    or more; trees: the trained size; probes: the best chain's block, at least
    :data:`PROBE_WIDTH`; None: nothing drafted);
    ``probe``: a plain step that also drafts, to observe the drafter's acceptance
    while plain decoding wins; ``steps``: plain steps to run before the next plan."""

    mode: str
    width: int
    probe: bool = False
    block: Optional[int] = None
    steps: int = 1


def parse_block_size(value) -> Optional[int | str]:
    """``--block-size``: ``auto``, an integer, or None (the drafter's trained size).

    Raises:
        InputError: neither an integer nor ``auto``, or an integer below 2.
    """
    if value is None or value == AUTO or isinstance(value, int):
        return value
    try:
        n = int(value)
    except ValueError:
        raise InputError(f"--block-size must be an integer or 'auto', got {value!r}") from None
    check_number("--block-size", n, at_least=2, rule="at least 2 (or 'auto')")
    return n


def parse_tree_budget(value) -> Optional[int | str]:
    """``--tree-budget``: ``auto``, an integer N >= 1 (tree nodes besides the root), or None.

    Raises:
        InputError: anything else.
    """
    if value is None or value == AUTO:
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InputError(f"--tree-budget must be a node count >= 1 or 'auto', got {value!r}") from None
    check_number("--tree-budget", n, at_least=1, rule="a node count >= 1 or 'auto'")
    return n


class Policy:
    """Chooses each step's :class:`Plan`.

    Args:
        draft_block: B, the block the drafter drafts (its trained size, or a fixed
            ``--block-size``); chains verify 2..B tokens, trees reach depth B-1.
        adaptive: choose the width per step (``--block-size auto``); else chains of B.
        tree_budget: None (chains only), a node count, or ``auto``.
        cost: the cost model (calibrated, see :func:`calibrated_cost`).
        timings: the source of each step's seconds (default :data:`DEFAULT_TIMINGS`).
    """

    def __init__(self, draft_block: int, adaptive: bool, tree_budget: Optional[int | str], cost: CostModel,
                 timings: Optional[Timings] = None):
        self.block = draft_block
        self.timings = timings or DEFAULT_TIMINGS
        self.keep = lambda: None  # saves what the cost model learned (set by make_policy)
        self.adaptive = adaptive
        self.tree_budget = tree_budget
        self.cost = cost
        self.plain_run = 0  # plain steps chosen in a row
        self.close = False  # whether plain decoding wins by little (probes stay frequent)
        self.resolve = PLAIN_RUN  # most steps of the next plain run (short after a probe)
        self.chain_run, self.last = 0, None  # chains of the same width in a row, and that plan
        self.budgets = tree_budgets(tree_budget)

    @property
    def learning(self) -> bool:
        """Whether the cost model chooses (and so learns from every step)."""
        return self.adaptive or self.tree_budget == AUTO

    @property
    def max_verify(self) -> int:
        """Most tokens one target forward may feed (for the cache's rollback slack)."""
        return max([self.block] + [n + 1 for n in self.budgets])

    def next(self, context: int = 0) -> Plan:
        """The step to run after ``context`` tokens, before anything of it is drafted
        (a tree choice among budgets, or between a tree and a chain, is refined by
        :meth:`after_draft`)."""
        B = self.block
        if self.tree_budget not in (None, AUTO):  # a fixed budget: always that tree
            return Plan(TREE, int(self.tree_budget), block=B)
        if not self.adaptive and self.tree_budget is None:
            return Plan(CHAIN, B, block=B)
        if self.chain_run % REDECIDE and self.last is not None:
            self.chain_run += 1
            return self._chain(self.last.width)
        if self.adaptive:
            best, chain_rate = self.cost.best_rate(range(2, B + 1), context)
        else:
            best, chain_rate = B, self.cost.rate(B, context) or 0.0
        tree = self._best_tree_rate(context)
        speculative = max(chain_rate, tree[0] if tree is not None else 0.0)
        plain = self.cost.rate(1, context) or 0.0
        # Plain decoding sees the drafter only through probes, so a wrong turn to it
        # lasts: it must win by a margin to be taken, and nothing to be kept.
        if plain > speculative * (1.0 if self.plain_run else 1.0 + PLAIN_MARGIN):
            self.close = speculative * (1.0 + CLOSE) >= plain
            return self._plain(self.close, best)
        self.plain_run = 0
        self.cost.speculating()
        if tree is not None and tree[0] > chain_rate:
            self.chain_run, self.last = 0, None
            return Plan(TREE, tree[1], block=B)
        self.chain_run = 1
        return self._chain(best)

    def _chain(self, width: int) -> Plan:
        block = self.cost.probe_block(self.cost.draft_block(width)) if self.adaptive else self.block
        self.last = Plan(CHAIN, width, block=block)
        return self.last

    def _plain(self, close: bool, best: int) -> Plan:
        """Plain steps up to the next probe (at most :data:`PLAIN_RUN`), or the probe:
        a plain step that also drafts, at the block the best chain (``best`` wide, at
        least :data:`PROBE_WIDTH`) would draft: what it would accept is what matters."""
        self.chain_run, self.last = 0, None
        steps = min(self.cost.plain_steps_before_probe(), PLAIN_RUN, self.resolve)
        self.resolve = PLAIN_RUN
        if steps == 0:
            self.cost.probed(close)
            self.plain_run += 1
            block = self.cost.draft_block(max(best, PROBE_WIDTH)) if self.adaptive else self.block
            self.resolve = block  # a short run next, so the probe's drafts are judged before a long one
            return Plan(PLAIN, 1, probe=True, block=block)
        self.cost.since_probe += steps
        self.plain_run += steps
        return Plan(PLAIN, 1, steps=steps)

    def observe(self, plan: Plan, seconds: Optional[float], overhead: float, context: int, drafts: Sequence[int],
                history: Sequence[int], base: int) -> None:
        """Learn from one finished step (only when the cost model chooses).

        Args:
            plan: the step that ran (after :meth:`after_draft`).
            seconds: its wall time drafting and verifying, or None when it does not
                stand for one step's cost (a plain step at either end of a pipelined run).
            overhead: seconds of the step before outside drafting and verifying
                (planning, acceptance bookkeeping, statistics).
            context: tokens before the step: the position of its last committed token,
                which its drafts follow.
            drafts: the block's top-1 drafts (empty when nothing was drafted).
            history: committed tokens; ``history[i]`` sits at position ``base + i``.
        """
        if not self.learning:
            return
        cost = self.cost
        width = plan.width + (plan.mode == TREE)
        block = plan.block if plan.mode != PLAIN or plan.probe else None  # a probe drafts too
        if seconds is not None:
            cost.record_step(plan.mode, width, self.timings.step(plan.mode, width, seconds, block), context, block,
                             self.timings.overhead(overhead), steps=plan.steps)
        if drafts:
            cost.record_drafts(context + 1, drafts)
        tail = history[-3 * self.block:]  # every block still pending lies within it
        cost.record_committed(tail, base + len(history) - len(tail))
        if plan.mode == TREE:
            committed = base + len(history) - 1 - context  # tokens this step committed
            cost.record_tree(plan.width, 0.0, committed)

    def _best_tree_rate(self, context: int) -> Optional[Tuple[float, int]]:
        """The best tree's rate from its observed tokens per step (before drafting)."""
        rates = []
        for n in self.budgets:
            seen = self.cost.tree_tokens.get(n)
            expected = seen.value if seen is not None and seen.value else self.cost.expected_tokens(self.block)
            if (r := self.cost.tree_rate(n, expected, context)) is not None:
                rates.append((r, n))
        return max(rates) if rates else None

    def after_draft(self, plan: Plan, root: int, logprobs: np.ndarray, context: int = 0
                    ) -> Tuple[Plan, Optional[DraftTree]]:
        """With the block's log-probabilities on the host, the tree to verify (built
        once): for ``--tree-budget auto`` the budget (or chain width) with the best rate
        for this very block.

        Returns:
            ``(plan, tree)``: ``tree`` is None when the plan is a chain.
        """
        nodes = build_tree(root, logprobs, max(plan.width, *self.budgets))  # a smaller budget's tree is a prefix
        if self.tree_budget != AUTO:
            return plan, nodes.prefix(plan.width)
        chain = np.exp(np.cumsum(logprobs.max(axis=-1).astype(np.float64))).tolist()
        pairs = [(d, float(np.exp(s))) for d, s in zip(nodes.depths[1:], nodes.scores[1:])]
        options = []
        for n in self.budgets:
            expected = self.cost.tree_expected_tokens(n, pairs[:n], chain)
            if (r := self.cost.tree_rate(n, expected, context)) is not None:
                options.append((r, TREE, n))
        width = self.cost.best_width(range(2, self.block + 1), context) if self.adaptive else self.block
        if (r := self.cost.rate(width, context)) is not None:
            options.append((r, CHAIN, width))
        if not options:
            return plan, nodes.prefix(plan.width)
        _, mode, width = max(options)
        return Plan(mode, width, block=self.block), (nodes.prefix(width) if mode == TREE else None)


def tree_budgets(tree_budget: Optional[int | str]) -> Tuple[int, ...]:
    """The tree budgets a ``--tree-budget`` value verifies: none, one, or all of :data:`TREE_BUDGETS`."""
    if tree_budget is None:
        return ()
    return TREE_BUDGETS if tree_budget == AUTO else (int(tree_budget),)


DEFAULT_TIMINGS: Timings = MeasuredTimings()  # tests replace it (tests/conftest.py) so no test reads the clock
_CALIBRATIONS: Dict[tuple, Calibration] = {}
_MODELS: Dict[int, tuple] = {}  # id(drafter) -> (weak reference, {key: CostModel})
_RECALIBRATE: set = set()  # ids of drafters whose next generation recalibrates


def calibrated_cost(target, drafter, draft_block: int, widths: Sequence[int], timings: Timings,
                    store: Optional[CalibrationStore] = None, key: Optional[dict] = None,
                    recalibrate: bool = False) -> Tuple[CostModel, str]:
    """The :class:`CostModel` of this target and drafter, and where its seconds came from.

    In a process, the same model (with what it learned of the drafter's acceptance)
    serves the drafter's later generations: chat turns, server requests, bench
    prompts. A new process starts from the ``store``'s entry under ``key`` when there
    is one: no calibration, and the acceptance profile of earlier runs. Otherwise
    ``timings`` calibrates, and the acceptance profile comes from this process or the
    store when either has one (``recalibrate`` re-times, it does not forget).

    Returns:
        ``(cost, source)``, source ``"kept"`` (this process), ``"stored"`` (the
        store), ``"timed"`` (calibrated now) or ``"fixed"`` (given timings).
    """
    ident = (id(target), id(getattr(drafter, "inner", drafter)), draft_block, tuple(sorted(set(widths))), id(timings))
    models = _models_of(drafter)
    previous = models.get(ident)
    if previous is not None and not recalibrate:
        previous.pending = []  # positions of another generation; probes keep their count across generations
        return previous, "kept"
    cost = CostModel(block_size=draft_block)
    stored = store.load(key) if store is not None and key is not None else None
    if stored is not None and not recalibrate and cost.restore(stored, timings=True):
        models[ident] = cost
        return cost, "stored"
    if ident not in _CALIBRATIONS or recalibrate:
        blocks = [w for w in widths if 2 <= w <= draft_block]
        _CALIBRATIONS[ident] = timings.calibrate(target, drafter, widths, blocks)
    cost.calibrate(_CALIBRATIONS[ident])
    learned = previous.state() if previous is not None else stored
    if learned is not None:
        cost.restore(learned, timings=False)  # the acceptance profile seen before
    models[ident] = cost
    return cost, ("timed" if getattr(timings, "measured", False) else "fixed")


def recalibrate(drafter) -> None:
    """The next generation with ``drafter`` times the widths again (``--recalibrate``)
    instead of reusing a calibration kept in this process or on disk; what it learned
    of the drafter's acceptance is kept."""
    _RECALIBRATE.add(id(getattr(drafter, "inner", drafter)))


def _models_of(drafter) -> dict:
    """This drafter's cost models, kept while the drafter lives (by id, checked through
    a weak reference: drafters are dicts, so they cannot be weak dictionary keys)."""
    entry = _MODELS.get(id(drafter))
    if entry is not None and entry[0]() is drafter:
        return entry[1]
    try:
        key = id(drafter)
        ref = weakref.ref(drafter, lambda _, key=key: _MODELS.pop(key, None))
    except TypeError:  # not weakly referable: nothing is kept
        return {}
    _MODELS[key] = (ref, {})
    return _MODELS[key][1]


def timed_widths(draft_block: int, budgets: Sequence[int]) -> List[int]:
    """Widths worth timing: 1, powers of two up to B, B, and each tree's width (the
    block sizes a chain may be drafted at are those from 2 to B)."""
    widths = {1, draft_block} | {w for w in (2, 4, 8, 16, 32) if w < draft_block}
    return sorted(widths | {n + 1 for n in budgets})


def make_policy(target, drafter, draft_block: int, adaptive: bool, tree_budget: Optional[int | str], stats,
                timings: Optional[Timings] = None, recalibrate: bool = False) -> Policy:
    """The policy for one generation, with ``stats.verify`` saying what runs and why.

    Trees need a target family with tree verify (:attr:`TargetAdapter.supports_tree`;
    hybrid Gated-DeltaNet families keep chains: their recurrent state has no
    per-node rows to keep or drop) and a drafter that gives per-position
    log-probabilities; otherwise chains run and the reason is recorded.

    Args:
        timings: where seconds come from (default :data:`DEFAULT_TIMINGS`, the clock),
            and its ``store`` where they are kept for a pair loaded from folders
            (see :func:`calibrated_cost`).
        recalibrate: time the widths again even when a calibration is kept.
    """
    reason = None
    if tree_budget is not None and not target.supports_tree:
        reason = f"{type(target).__name__} targets verify chains only (no tree verify for this family)"
        tree_budget = None
    elif tree_budget is not None and not callable(getattr(drafter, "propose", None)):
        reason = "this drafter gives no per-position log-probabilities to build a tree from"
        tree_budget = None
    if mx.distributed.init().size() > 1:  # auto is timed on each rank apart: ranks must verify alike
        adaptive = False
        if tree_budget == AUTO:
            tree_budget, reason = None, "--tree-budget auto is timed on each rank apart; pass a number"
    adaptive = adaptive and tree_budget in (None, AUTO)  # a fixed tree budget fixes the verify
    stats.verify = {"block_size": AUTO if adaptive else draft_block, "tree_budget": tree_budget, "reason": reason}
    timings = timings or DEFAULT_TIMINGS
    policy = Policy(draft_block, adaptive, tree_budget, CostModel(block_size=draft_block), timings)
    if policy.learning:
        widths = timed_widths(draft_block, policy.budgets)
        store = getattr(timings, "store", None)
        key = store_key(target, drafter, draft_block, widths) if store is not None else None
        inner = id(getattr(drafter, "inner", drafter))
        recalibrate = recalibrate or inner in _RECALIBRATE
        _RECALIBRATE.discard(inner)
        tic = time.perf_counter()
        policy.cost, source = calibrated_cost(target, drafter, draft_block, widths, timings, store, key, recalibrate)
        stats.calibration_s = time.perf_counter() - tic  # kept out of the prompt's time
        stats.verify["calibration"] = source
        if key is not None:
            policy.keep = lambda: store.save(key, policy.cost.state())
    return policy
