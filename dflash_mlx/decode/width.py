"""The width chooser's interface (issue 40), as a thin adapter onto :mod:`.policy` (one
sequence) and :mod:`.batch_width` (a batch). Replaced at merge by the ``width`` helper's module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .batch_width import BatchWidths
from .cost import PLAIN, TREE
from .policy import AUTO, Plan as _Inner, make_policy, parse_block_size, parse_tree_budget

__all__ = ["AUTO", "Plan", "WidthChooser", "make_chooser", "parse_block_size", "parse_tree_budget"]


@dataclass
class Plan:
    """One step: ``width`` tokens verified per sequence (1: a plain step), ``block`` the block
    drafted (0: no draft), ``tree_budget`` DDTree nodes (N == 1 only) or None for a chain."""

    width: int
    block: int
    tree_budget: Optional[int] = None


class WidthChooser:
    """Chooses each step's :class:`Plan` for ``n`` sequences and learns from what it did."""

    def __init__(self, policy, block: int, adaptive: bool):
        self.policy, self.block, self.adaptive = policy, block, adaptive
        self.max_verify = policy.max_verify
        self.batch = BatchWidths(block) if adaptive else None
        self.position, self.inner, self.left, self.observed = 0, None, 0, 0

    def plan(self, n: int, seeded: bool = False) -> Plan:
        if seeded or (n > 1 and self.batch is None):
            return Plan(self.block, self.block)
        if n > 1:
            w = self.batch.choose(n)
            return Plan(w, w if w > 1 else 0)
        if self.left == 0:
            self.inner = self.policy.next(self.position)
            self.left = self.inner.steps if self.inner.mode == PLAIN else 1
        self.left -= 1
        p = self.inner
        if p.mode == PLAIN:  # a probe verifies its drafted block, so acceptance stays known
            out = Plan(p.block, p.block) if p.probe else Plan(1, 0)
        else:
            out = Plan(p.width, p.block, p.width if p.mode == TREE else None)
        out.inner, out.last = p, self.left == 0
        return out

    def after_draft(self, plan: Plan, root: int, logprobs: Optional[np.ndarray]) -> Plan:
        """With the block's log-probabilities [B-1, V] on the host: the tree (or chain) to verify."""
        if logprobs is None:
            return Plan(self.block, self.block)
        p, _ = self.policy.after_draft(plan.inner, root, logprobs, self.position)
        out = Plan(p.width, self.block, p.width if p.mode == TREE else None)
        out.inner, out.last = p, True
        return out

    def observe(self, plan: Plan, seconds: float, accepted: Sequence[int]) -> None:
        inner = getattr(plan, "inner", None)
        if inner is None:
            if self.batch is not None and len(accepted) > 1:
                self.batch.observe(self.batch.clock() - seconds, plan.width, accepted)
            return
        a = accepted[0]
        if plan.last and not inner.probe:
            self.policy.observe(inner, seconds, 0.0, self.position, [], [], self.position + a + 1)
        if plan.last and self.policy.learning and plan.width > 1:
            self.policy.cost._observe(a, plan.width - 1 if plan.tree_budget is None else a + 1)
        self.position += a + 1
        self.observed += 1
        if self.observed % 64 == 1:
            self.policy.keep()


def make_chooser(target, drafter, block_size, tree_budget, stats) -> WidthChooser:
    """The chooser of one generation (or one batch): a fixed block size gives a constant plan."""
    from .generate import check_block_size

    B = check_block_size(block_size, drafter)
    policy = make_policy(target, drafter, B, block_size == AUTO, parse_tree_budget(tree_budget), stats)
    return WidthChooser(policy, B, block_size == AUTO)
