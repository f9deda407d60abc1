"""Which step the decode loop runs next: plain, a chain verify of some width, or a tree.

``--block-size auto`` (the CLI default) and ``--tree-budget auto`` let the cost model
(:mod:`dflash_mlx.cost`) choose per step, from timings taken on this machine: plain
steps, chains of any width up to the drafted block, and (tree auto) trees of 8..64
nodes. A fixed ``--block-size B`` always verifies chains of B; a fixed
``--tree-budget N`` always verifies trees of N nodes, drafted at B.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .cost import CHAIN, PLAIN, TREE, CostModel
from .errors import InputError
from .tree import DraftTree, build_tree

AUTO = "auto"
TREE_BUDGETS = (8, 16, 32, 64)  # the budgets --tree-budget auto chooses among
TIMED_REPEATS = 3
REDECIDE_PLAIN = 4  # while plain decoding wins, the width is re-chosen every this many steps


@dataclass
class Plan:
    """The next step: ``mode`` plain (width 1), chain (``width`` tokens) or tree
    (``width`` = budget N nodes); ``probe``: a plain step that also drafts, to
    observe the drafter's acceptance while plain decoding wins."""

    mode: str
    width: int
    probe: bool = False


def parse_block_size(value) -> Optional[int | str]:
    """``--block-size``: ``auto``, an integer, or None (the drafter's trained size).

    Raises:
        InputError: neither an integer nor ``auto``.
    """
    if value is None or value == AUTO or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise InputError(f"--block-size must be an integer or 'auto', got {value!r}") from None


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
    if n < 1:
        raise InputError(f"--tree-budget must be a node count >= 1 or 'auto', got {n}")
    return n


class Policy:
    """Chooses each step's :class:`Plan`.

    Args:
        draft_block: B, the block the drafter drafts (its trained size, or a fixed
            ``--block-size``); chains verify 2..B tokens, trees reach depth B-1.
        adaptive: choose the width per step (``--block-size auto``); else chains of B.
        tree_budget: None (chains only), a node count, or ``auto``.
        cost: the cost model (calibrated, see :func:`calibrate`).
    """

    def __init__(self, draft_block: int, adaptive: bool, tree_budget: Optional[int | str], cost: CostModel):
        self.block = draft_block
        self.adaptive = adaptive
        self.tree_budget = tree_budget
        self.cost = cost
        self.plain_run = 0  # plain steps chosen in a row
        self.budgets = tree_budgets(tree_budget)

    @property
    def learning(self) -> bool:
        """Whether the cost model chooses (and so learns from every step)."""
        return self.adaptive or self.tree_budget == AUTO

    @property
    def max_verify(self) -> int:
        """Most tokens one target forward may feed (for the cache's rollback slack)."""
        return max([self.block] + [n + 1 for n in self.budgets])

    def next(self) -> Plan:
        """The step to run before anything of it is drafted (a tree choice among
        budgets, or between a tree and a chain, is refined by :meth:`after_draft`)."""
        if self.tree_budget not in (None, AUTO):  # a fixed budget: always that tree
            return Plan(TREE, int(self.tree_budget))
        if not self.adaptive and self.tree_budget is None:
            return Plan(CHAIN, self.block)
        if self.plain_run and self.plain_run % REDECIDE_PLAIN:  # plain runs re-decide every few steps
            self.plain_run += 1
            return Plan(PLAIN, 1, probe=self.cost.should_probe())
        best = self.cost.best_width(range(1, self.block + 1)) if self.adaptive else self.block
        tree = self._best_tree_rate()
        if best == 1 and (tree is None or tree[0] <= (self.cost.rate(1) or 0.0)):
            self.plain_run += 1
            return Plan(PLAIN, 1, probe=self.cost.should_probe())
        self.plain_run = 0
        self.cost.speculating()
        if tree is not None and tree[0] > (self.cost.rate(best) or 0.0):
            return Plan(TREE, tree[1])
        return Plan(CHAIN, best)

    def _best_tree_rate(self) -> Optional[Tuple[float, int]]:
        """The best tree's rate from its observed tokens per step (before drafting)."""
        rates = []
        for n in self.budgets:
            seen = self.cost.tree_tokens.get(n)
            expected = seen.value if seen is not None and seen.value else self.cost.expected_tokens(self.block)
            if (r := self.cost.tree_rate(n, expected)) is not None:
                rates.append((r, n))
        return max(rates) if rates else None

    def after_draft(self, plan: Plan, root: int, logprobs: np.ndarray) -> Tuple[Plan, Optional[DraftTree]]:
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
            if (r := self.cost.tree_rate(n, expected)) is not None:
                options.append((r, TREE, n))
        width = self.cost.best_width(range(2, self.block + 1)) if self.adaptive else self.block
        if (r := self.cost.rate(width)) is not None:
            options.append((r, CHAIN, width))
        if not options:
            return plan, nodes.prefix(plan.width)
        _, mode, width = max(options)
        return Plan(mode, width), (nodes.prefix(width) if mode == TREE else None)


def tree_budgets(tree_budget: Optional[int | str]) -> Tuple[int, ...]:
    """The tree budgets a ``--tree-budget`` value verifies: none, one, or all of :data:`TREE_BUDGETS`."""
    if tree_budget is None:
        return ()
    return TREE_BUDGETS if tree_budget == AUTO else (int(tree_budget),)


def calibrate(target, drafter, draft_block: int, widths: Sequence[int], context_rows: int = 64) -> Tuple[Dict[int, float], float]:
    """Time the target's forward at each width and one drafter pass on scratch caches
    (the real caches are never touched), median of a few runs after a warm-up.

    Returns:
        ``({width: seconds}, drafter pass seconds)``.
    """
    V = target.vocab_size
    context = mx.arange(context_rows, dtype=mx.int32) % V
    cache = target.make_cache(max(widths))
    _, features = target(context[None], cache, drafter.target_layer_ids)
    mx.eval([c.state for c in cache], features)
    token = mx.array([1], dtype=mx.int32)
    times: Dict[int, float] = {}
    for n in sorted(set(widths)):
        runs = []
        for _ in range(TIMED_REPEATS + 1):
            tic = time.perf_counter()
            h, f = target(mx.full((1, n), 1, dtype=mx.int32), cache, drafter.target_layer_ids)
            mx.eval(target.lm_head(h), f)
            runs.append(time.perf_counter() - tic)
            target.rollback(cache, n)
        times[n] = statistics.median(runs[1:])
    runs = []
    for _ in range(TIMED_REPEATS + 1):
        draft_cache = drafter.make_cache()
        tic = time.perf_counter()
        mx.eval(drafter.draft(token, features, draft_cache, draft_block))
        runs.append(time.perf_counter() - tic)
    # The drafter pass above also caches the context rows; a real pass adds a few.
    return times, statistics.median(runs[1:])


_CALIBRATIONS: Dict[tuple, Tuple[Dict[int, float], float]] = {}
_MODELS: Dict[int, tuple] = {}  # id(drafter) -> (weak reference, {key: CostModel})


def calibrated_cost(target, drafter, draft_block: int, widths: Sequence[int]) -> CostModel:
    """The :class:`CostModel` of this target and drafter: its timings measured once per
    process (at the first generation), then refreshed by every step. The same model,
    with what it has learned of the drafter's acceptance, serves the drafter's later
    generations in this process (chat turns, server requests, bench prompts)."""
    key = (id(target), id(getattr(drafter, "inner", drafter)), draft_block, tuple(sorted(set(widths))))
    models = _models_of(drafter)
    cost = models.get(key)
    if cost is not None:
        cost.pending, cost.since_probe = [], 0
        return cost
    if key not in _CALIBRATIONS:
        _CALIBRATIONS[key] = calibrate(target, drafter, draft_block, widths)
    times, draft_s = _CALIBRATIONS[key]
    cost = CostModel(block_size=draft_block)
    widths = sorted(times)
    for i, n in enumerate(widths):  # more tokens never cost less: a slow outlier (a busy machine) is capped
        cost.record_verify(n, min(times[m] for m in widths[i:]))
    cost.record_draft(draft_s)
    models[key] = cost
    return cost


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
    """Widths worth timing: 1, powers of two up to B, B, and each tree's width."""
    widths = {1, draft_block} | {w for w in (2, 4, 8, 16, 32) if w < draft_block}
    return sorted(widths | {n + 1 for n in budgets})


def make_policy(target, drafter, draft_block: int, adaptive: bool, tree_budget: Optional[int | str],
                stats) -> Policy:
    """The policy for one generation, with ``stats.verify`` saying what runs and why.

    Trees need a target family with tree verify (:attr:`TargetAdapter.supports_tree`;
    hybrid Gated-DeltaNet families keep chains: their recurrent state has no
    per-node rows to keep or drop) and a drafter that gives per-position
    log-probabilities; otherwise chains run and the reason is recorded.

    """
    reason = None
    if tree_budget is not None and not target.supports_tree:
        reason = f"{type(target).__name__} targets verify chains only (no tree verify for this family)"
        tree_budget = None
    elif tree_budget is not None and not callable(getattr(drafter, "propose", None)):
        reason = "this drafter gives no per-position log-probabilities to build a tree from"
        tree_budget = None
    adaptive = adaptive and tree_budget in (None, AUTO)  # a fixed tree budget fixes the verify
    stats.verify = {"block_size": AUTO if adaptive else draft_block, "tree_budget": tree_budget, "reason": reason}
    policy = Policy(draft_block, adaptive, tree_budget, CostModel(block_size=draft_block))
    if policy.learning:
        tic = time.perf_counter()
        policy.cost = calibrated_cost(target, drafter, draft_block, timed_widths(draft_block, policy.budgets))
        stats.calibration_s = time.perf_counter() - tic  # kept out of the prompt's time
    return policy
