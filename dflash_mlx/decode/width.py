"""How many tokens each decode step verifies: ``--block-size`` / ``--tree-budget``, fixed or ``auto``.

``auto`` runs the option with the highest rate(w, n) = n * E[tokens | w] / seconds(w, n) over plain steps, chains of 2,
4, ..., B and (``--tree-budget auto``, one sequence) a tree of :data:`AUTO_TREE` nodes. E comes from the draft survival
observed (Kaplan-Meier, each position starting at :data:`PRIOR` with :data:`PRIOR_WEIGHT` steps' weight; every step ages
the evidence and the prior alike by :data:`DECAY`, the prior down to 1e-9, so plain steps change no estimate but make
the next observation weigh more; a run of first-draft misses less likely than :data:`CHANGE` at the S(1) learned cuts
the older evidence to the run's weight: a long memory keeps a drafter that misses often, but no more than learned, on
its chains, and one that stopped agreeing is left within a few steps); seconds(w, n) is the median of its last
:data:`WINDOW` timings (other work on the machine only adds time, in bursts a mean follows; the first run of each (w, n)
is left out and run again at once). A chain's rate is divided by :data:`PLAIN_MARGIN`, so only a measured gain moves off
plain. It starts with plain steps: until drafting is measured to pay, it does not run. A batch that no request waits to
join lasts as long as its slowest reply, so there E is what a chain commits for the reply it is expected to leave
furthest behind.

A later generation of the same pair may start from what an earlier one learned (:meth:`WidthChooser.state`,
kept by the prompt cache): it then runs the best option at once and, a chain best, keeps the earlier one's probe
schedule (its next probe where that schedule put it, after :data:`PROBE_EVERY` steps at the earliest; a plain best
probes after :data:`FIRST_GAP`), timing each option again (learned timings may come from a busier machine).

Other options run as probes, one step each (a chain not timed here: two, unless the first one's drafts already show it
cannot beat the best), one per gap of steps: the gap starts at :data:`FIRST_GAP` and returns there after a probe that
beat the best (or, plain being best, accepted every draft), is :data:`PROBE_EVERY` after a chain within :data:`CLOSE` of
a best chain, else grows fourfold up to :data:`MAX_GAP`. The probe: plain while untimed, else the untimed option nearest
the best whose most (:meth:`WidthChooser.promise`) beats the best rate, else the best timed one."""

import math
import statistics
from dataclasses import astuple, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import InputError
from ..ranges import check_number

AUTO = "auto"
PRIOR = 0.6  # conditional acceptance of a draft position never verified
PRIOR_WEIGHT = 0.25  # steps' worth of weight the prior carries per position
DECAY = 0.99  # weight of older steps' evidence (and of the prior), per step
CHANGE = 1e-3  # a run of first-draft misses less likely than this under the survival learned marks a change
MAX_WEIGHT = 1e6  # above what DECAY lets any batch's steps weigh: a learned state holding more is refused
WINDOW = 6  # timings kept per (option, n)
FIRST_GAP = 2  # steps before the first probe, and after one that beat the best
PROBE_EVERY = 8  # the gap after a chain probe that came close to a best chain
MAX_GAP = 64  # the longest gap between two probes, in steps
PLAIN_MARGIN = 1.02  # a chain must beat plain steps' measured rate by this to be chosen over them
CLOSE = 0.9  # while a chain is best, a chain probe within this fraction of its rate keeps the gap short
AUTO_TREE = 16  # tree nodes --tree-budget auto weighs against chains
OWN_WEIGHT = 4.0  # drafts' worth of the pooled survival each sequence's own acceptance starts from


@dataclass(frozen=True)
class Plan:
    """One step: ``width`` tokens verified per sequence (1: a plain step; else t_last and
    ``width - 1`` drafts); ``block``: the block drafted (>= width; 0 when nothing is
    drafted); ``tree_budget``: DDTree nodes besides the root (one sequence), None for a chain."""

    width: int
    block: int
    tree_budget: Optional[int] = None


def parse_auto(flag: str, value, at_least: int, what: str, rule: str) -> Optional[int | str]:
    """``flag``'s value: ``auto``, an integer >= ``at_least``, or None. Raises InputError naming ``flag``: neither
    ``what`` nor ``auto``, or below ``at_least`` (said as ``rule``)."""
    if value is None or value == AUTO:
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InputError(f"{flag} must be {what} or 'auto', got {value!r}") from None
    check_number(flag, n, at_least=at_least, rule=rule)
    return n


def parse_block_size(value) -> Optional[int | str]:
    """``--block-size``: ``auto``, an integer >= 2 (an int as given: the drafter's range is checked later), or None
    (the drafter's trained size)."""
    return value if isinstance(value, int) else parse_auto("--block-size", value, 2, "an integer",
                                                           "at least 2 (or 'auto')")


def parse_tree_budget(value) -> Optional[int | str]:
    """``--tree-budget``: ``auto``, a node count N >= 1 (besides the root), or None."""
    return parse_auto("--tree-budget", value, 1, "a node count >= 1", "a node count >= 1 or 'auto'")


def chain_widths(block: int) -> List[int]:
    """The chain widths auto weighs: 2, 4, 8, ... below ``block``, and ``block``."""
    return [2**i for i in range(1, block.bit_length()) if 2**i < block] + [block]


class Survival:
    """Per draft position k (1-based), the weighted counts of blocks that reached k and of those whose
    draft k was right, and the weight of the prior (aged alike: ageing changes no estimate); ``misses``: chains in a
    row whose first draft was wrong."""

    def __init__(self, block: int):
        self.reached = [0.0] * block
        self.right = [0.0] * block
        self.prior = PRIOR_WEIGHT
        self.misses = 0

    def observe(self, width: int, accepted: int) -> None:
        """One chain of ``width`` tokens that accepted ``accepted`` drafts, after the change test (the module's)."""
        self.misses = 0 if accepted else self.misses + 1
        older = self.reached[1] - max(self.misses - 1, 0)  # the run so far weighs about 1 a step
        if self.misses and older > self.misses and (1.0 - self.conditional(1)) ** self.misses < CHANGE:
            cut = self.misses / older  # once a run: the older evidence then weighs no more than it
            self.reached, self.right = [r * cut for r in self.reached], [r * cut for r in self.right]
            self.reached[1] += (self.misses - 1) * (1.0 - cut)
        for k in range(1, min(accepted + 1, width - 1) + 1):
            self.reached[k] += 1.0
            self.right[k] += k <= accepted

    def decay(self) -> None:
        """Older steps (and the prior, down to 1e-9: a position never reached stays at PRIOR) weigh :data:`DECAY` as
        much: a step's evidence never outweighs the next one's by more than its age says."""
        self.reached, self.right = [r * DECAY for r in self.reached], [r * DECAY for r in self.right]
        self.prior = max(self.prior * DECAY, 1e-9)

    def conditional(self, k: int, prior: float = PRIOR) -> float:
        """S(k): the chance that draft k is right where drafts 1..k-1 were, ``prior`` weighing :attr:`prior`."""
        return (self.right[k] + prior * self.prior) / (self.reached[k] + self.prior)

    def moments(self, width: int, prior: float = PRIOR) -> Tuple[float, float]:
        """Mean and variance of the tokens a chain of ``width`` commits, 1 + A with P(A >= k) = P_k = S(1)...S(k),
        k < width: E = 1 + sum of P_k, Var = sum of (2k - 1) P_k - (sum of P_k)^2; ``prior``: S without evidence."""
        drafts, square, s = 0.0, 0.0, 1.0
        for k in range(1, width):
            s *= self.conditional(k, prior)
            drafts, square = drafts + s, square + (2 * k - 1) * s
        return 1.0 + drafts, max(0.0, square - drafts * drafts)


class WidthChooser:
    """Plans every step's width and learns from the steps that ran.

    Args:
        block: B, the widest chain. fixed: the plan every step runs, or None (auto).
        tree: also weigh a tree of :data:`AUTO_TREE` nodes (``--tree-budget auto``).

    Attributes:
        max_verify: most tokens one verify feeds per sequence (for cache sizing).
        probing: whether the last plan was a probe (for the statistics).
        verify: what runs and why, as :attr:`~dflash_mlx.stats.GenerationStats.verify` says it (set by
            :func:`make_chooser`)."""

    def __init__(self, block: int, fixed: Optional[Plan] = None, tree: bool = False):
        self.block, self.fixed = block, fixed
        self.options: List[Plan] = [Plan(1, 0)] + [Plan(w, w) for w in chain_widths(block)]
        if tree:
            self.options.append(Plan(AUTO_TREE + 1, block, AUTO_TREE))
        widest = fixed or max(self.options, key=lambda p: p.width)
        self.max_verify = max(block, widest.width)
        self.survival = Survival(max(block, 2))
        self.tree_tokens: List[float] = []  # tokens the last tree steps committed, per sequence
        self.seconds: Dict[Tuple[Plan, int], List[float]] = {}  # (option, n) -> its last timings
        self.learned: Dict[Tuple[Plan, int], List[float]] = {}  # timings an earlier generation left, until timed here
        self.best: Dict[int, Plan] = {}  # n -> the option planned as best
        self.gap = FIRST_GAP  # steps from one probe to the next
        self.steps = 0  # steps observed
        self.probed = 0  # the step of the last probe
        self.again: Optional[Plan] = None  # a probe whose first run paid its setup runs once more
        self.own: Dict[object, Tuple[float, float]] = {}  # sequence -> drafts accepted, and expected, aged
        self.behind: Optional[List[Tuple[object, int]]] = None  # the last plan's sequences where the last sets the end
        self.probing = False
        self.verify: Optional[Dict[str, object]] = None

    def plan(self, n: int = 1, seeded: bool = False, behind: Optional[List[Tuple[object, int]]] = None) -> Plan:
        """The next step for ``n`` active sequences; ``seeded``: a seeded sampled sequence
        is among them, whose text must not depend on timings (the fixed B runs). ``behind``: each sequence's
        (key, tokens it may still commit) where nothing waits to join, so the batch lasts as long as its slowest
        reply: chains are then weighed by what they commit for that one (:meth:`expected_tokens`)."""
        self.probing, self.behind = False, behind if behind and len(behind) > 1 else None
        if self.fixed is not None or seeded:  # a seeded sequence: the widest chain, whatever was measured
            return self.fixed or Plan(self.block, self.block)
        again, self.again = self.again, None
        if again in self.options:
            self.probing = True
            return again
        best = self.best[n] = self._best(n)
        if self.steps - self.probed < self.gap or (probe := self._probe(best, n)) is None:
            return best
        self.probed, self.probing = self.steps, True
        self.again = probe if (probe, n) not in self.seconds else None
        return probe

    def _probe(self, best: Plan, n: int) -> Optional[Plan]:
        """Plain while it is untimed, else the untimed option nearest ``best`` that could beat it, else the
        timed one with the highest rate."""
        options, plain = self.options, self.options[0]
        if best != plain and not self.seconds.get((plain, n)):
            return plain
        floor, i = self.rate(best, n), options.index(best)
        hopes = [(self.promise(p, n), p) for p in options if p != best]
        hopes = [(h, p) for h, p in hopes if h > floor or self.seconds.get((p, n))]
        untimed = [(abs(options.index(p) - i), -h, options.index(p)) for h, p in hopes if not self.seconds.get((p, n))]
        if untimed:
            return options[min(untimed)[2]]
        return max(hopes, key=lambda hp: hp[0])[1] if hopes else None

    def promise(self, plan: Plan, n: int) -> float:
        """``plan``'s rate, or not timed in this generation, the most it could commit per second: its E (a draft
        position without evidence counted right) over the seconds of the slowest other timed option no wider (a wider
        step is no faster) and, for a chain, no less than the widest narrower timed chain's carried on at the slope of
        the two widest (a CPU's verify grows with the tokens it feeds, a GPU's hardly); unbounded for a tree not yet run
        (it commits at least its best chain, but how much more the chains do not say)."""
        if self.seconds.get((plan, n)):
            return self.rate(plan, n)
        if plan.tree_budget is not None and not self.tree_tokens:
            return float("inf")
        timed = [(p, self._seconds(p, n)) for p in self.options
                 if p != plan and p.width <= plan.width and self._timings(p, n)]
        if not timed:
            return float("inf")
        floors = [t for _, t in timed]
        chains = sorted((p.width, t) for p, t in timed if 1 < p.width < plan.width and p.tree_budget is None)[-2:]
        if len(chains) == 2 and plan.tree_budget is None:  # the slope of the two widest, carried on to this width
            (wa, ta), (wb, tb) = chains
            floors.append(tb + max(0.0, (tb - ta) / (wb - wa)) * (plan.width - wb))
        return n * self.expected_tokens(plan, 1.0) / max(floors)

    def observe(self, plan: Plan, seconds: float, accepted: Sequence[int]) -> None:
        """One step that ran ``plan``: its wall ``seconds`` (the whole batched step) and each
        sequence's accepted drafts (plain steps: zeros)."""
        if self.fixed is not None:
            return
        n = len(accepted)
        self.steps += 1
        self.survival.decay()
        if plan.tree_budget is not None:
            self.tree_tokens = self.tree_tokens[1 - WINDOW :] + [sum(accepted) / max(n, 1) + 1.0]
        elif plan.width > 1:
            drafts = self.survival.moments(plan.width)[0] - 1.0
            if self.behind and len(self.behind) == n:  # each sequence's own acceptance against the pooled one
                self.own = {k: (a + DECAY * self.own.get(k, (0, 0))[0], drafts + DECAY * self.own.get(k, (0, 0))[1])
                            for (k, _), a in zip(self.behind, accepted)}
            for a in accepted:
                self.survival.observe(plan.width, a)
        key = (plan, n)  # the first run of a shape pays its setup: left out
        self.seconds[key] = self.seconds[key][1 - WINDOW :] + [seconds] if key in self.seconds else []
        best = self.best.get(n)
        if self.again == plan and best is not None and self.promise(plan, n) <= self.rate(best, n):
            self.again, self.gap = None, min(4 * self.gap, MAX_GAP)  # its first run's drafts rule it out: not rerun
        if best is not None and plan != best and self.seconds[key] and self.again is None:  # a probe measured
            near = CLOSE if best.width > 1 and plan.width > 1 else 1.0  # drafting pays: keep close chains timed
            rate, best_rate = self.rate(plan, n), self.rate(best, n)
            whole = best.width == 1 < plan.width and all(a == plan.width - 1 for a in accepted)  # drafts agree again
            self.gap = FIRST_GAP if rate > best_rate or whole else PROBE_EVERY if rate > near * best_rate else \
                min(4 * self.gap, MAX_GAP)

    def state(self) -> dict:
        """What auto learned, JSON-able, for :meth:`learn`: draft survival and one sequence's timings ({}: fixed)."""
        timings = {**self.learned, **{k: v for k, v in self.seconds.items() if v}}
        s, seconds = self.survival, [[*astuple(p), t] for (p, n), t in timings.items() if n == 1]
        return {} if self.fixed is not None else {"reached": s.reached, "right": s.right, "prior": s.prior,
                                                  "tree_tokens": self.tree_tokens, "seconds": seconds,
                                                  "gap": self.gap, "since": max(0, self.steps - self.probed)}

    def learn(self, state: dict) -> bool:
        """Start from ``state`` (:meth:`state` of an earlier generation, options not weighed here left out); a chain
        best keeps its probe schedule (``gap``, ``since``; absent in older states: due), the next probe at the earliest
        :data:`PROBE_EVERY` steps in (a plain best: :data:`FIRST_GAP`); False, nothing changed, where it is malformed
        or of another block size. Its timings choose the best until this generation times the options, each once as
        a probe (they may have been taken while other work ran)."""
        try:
            counts = [[float(x) for x in state[k]] for k in ("reached", "right", "tree_tokens")] + [[state["prior"]]]
            seconds = {(Plan(w, b, t), 1): [float(x) for x in v] for w, b, t, v in state["seconds"] if v}
            gap, since = int(state.get("gap", FIRST_GAP)), int(state.get("since", MAX_GAP))
            if self.fixed is not None or {len(c) for c in counts[:2]} != {len(self.survival.reached)} or not all(
                    0 <= x < MAX_WEIGHT for c in counts for x in c) or not (FIRST_GAP <= gap <= MAX_GAP and since >= 0):
                return False
        except (KeyError, TypeError, ValueError, OverflowError):
            return False
        (self.survival.reached, self.survival.right, self.tree_tokens), self.survival.prior = counts[:3], counts[3][0]
        self.learned.update({k: v[-WINDOW:] for k, v in seconds.items()
                             if k[0] in self.options and all(0 < x < math.inf for x in v)})
        chain = self._best(1).width > 1  # next probe once steps - probed reaches gap: max(PROBE_EVERY, gap - since) in
        self.gap, self.probed = (gap, max(PROBE_EVERY, gap - since) - gap) if chain else (FIRST_GAP, 0)
        return True

    def expected_tokens(self, plan: Plan, prior: float = PRIOR) -> float:
        """E[tokens committed per sequence] by ``plan`` (``prior``: S of a draft position without evidence); with
        :attr:`behind`, per step of the batch as its slowest reply sees it: each sequence's drafts scaled by its own
        acceptance against the pooled one (shrunk to it by :data:`OWN_WEIGHT`; never above it; its variance that of the
        pooled drafts thinned at that ratio), the most tokens left over the most steps any sequence is expected to
        need: each needs L/m steps for L tokens left at m a step, give or take sqrt(L v / m^3) (v: the variance of a
        step's tokens; renewal theory), and the slowest of n independent replies lies Blom's expected maximum of n
        standard normals above its mean."""
        if plan.tree_budget is not None and self.tree_tokens:
            return sum(self.tree_tokens) / len(self.tree_tokens)
        tokens, variance = self.survival.moments(plan.width if plan.tree_budget is None else self.block, prior)
        if not self.behind or plan.width == 1:
            return tokens
        n, steps = len(self.behind), []
        slowest = statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))  # Blom: E[the largest of n], standard
        for (_, left), (a, e) in zip(self.behind, [self.own.get(key, (0.0, 0.0)) for key, _ in self.behind]):
            r = min(1.0, (a + OWN_WEIGHT) / (e + OWN_WEIGHT))
            mean, var = 1.0 + (tokens - 1.0) * r, r * r * variance + r * (1.0 - r) * (tokens - 1.0)  # thinned drafts
            steps.append(left / mean + slowest * math.sqrt(left * var / mean**3))
        return max(left for _, left in self.behind) / max(steps)

    def _seconds(self, plan: Plan, n: int) -> float:
        """The median of ``plan``'s timings at ``n`` (0 untimed)."""
        return statistics.median(self._timings(plan, n) or [0.0])

    def _best(self, n: int) -> Plan:
        """The timed option with the highest rate at ``n`` (plain where none is timed)."""
        return max([p for p in self.options if self._timings(p, n)] or self.options[:1], key=lambda p: self.rate(p, n))

    def _timings(self, plan: Plan, n: int) -> List[float]:
        """``plan``'s timings at ``n`` in this generation, else those learned ([] for none)."""
        return self.seconds.get((plan, n)) or self.learned.get((plan, n), [])

    def rate(self, plan: Plan, n: int = 1) -> float:
        """Tokens per second ``plan`` is expected to commit for ``n`` sequences (0 untimed)."""
        seconds = self._seconds(plan, n)
        margin = 1.0 if plan.width == 1 else PLAIN_MARGIN
        return n * self.expected_tokens(plan) / seconds / margin if seconds > 0 else 0.0


def make_chooser(target, drafter, block_size: int | str, tree_budget) -> WidthChooser:
    """The chooser of one generation (or batch); its ``verify`` says what runs and why.

    ``block_size``: a fixed B or ``auto``; ``tree_budget``: None, a node count or ``auto`` (which implies
    auto widths). Trees need ``target.supports_tree`` and a drafter with ``propose``, else chains run."""
    auto = block_size == AUTO or tree_budget == AUTO
    block_size = drafter.block_size if block_size in (None, AUTO) else int(block_size)
    reason = None
    if tree_budget is not None and target is not None and not target.supports_tree:
        reason = f"{type(target).__name__} targets verify chains only (no tree verify for this family)"
        tree_budget = None
    elif tree_budget is not None and not callable(getattr(drafter, "propose", None)):
        reason = "this drafter gives no per-position log-probabilities to build a tree from"
        tree_budget = None
    ranks = mx.distributed.init().size()
    if ranks > 1 and tree_budget == AUTO:  # trees are planned per sequence state, not shared across ranks
        tree_budget, reason = None, "--tree-budget auto does not run on several ranks; pass a number"
    auto = (auto or tree_budget == AUTO) and tree_budget in (None, AUTO)  # a fixed tree budget fixes the verify
    if tree_budget not in (None, AUTO):
        chooser = WidthChooser(block_size, Plan(int(tree_budget) + 1, block_size, int(tree_budget)))
    elif not auto and tree_budget is None:
        chooser = WidthChooser(block_size, Plan(block_size, block_size))
    else:
        chooser = (SharedChooser if ranks > 1 else WidthChooser)(block_size, tree=tree_budget == AUTO)
    chooser.verify = {"block_size": AUTO if auto else block_size, "tree_budget": tree_budget, "reason": reason}
    return chooser


class SharedChooser(WidthChooser):
    """Auto under ``mlx.launch``: rank 0 plans each step from its own timings and every rank runs that plan
    (its index in :attr:`options`, summed over the ranks with the others giving 0), so all verify alike.
    Every rank observes every step, as each sees the same acceptance."""

    def plan(self, n: int = 1, seeded: bool = False, behind: Optional[List[Tuple[object, int]]] = None) -> Plan:
        group = mx.distributed.init()
        index = self.options.index(super().plan(n, seeded, behind)) if group.rank() == 0 else 0
        return self.options[int(mx.distributed.all_sum(mx.array([index], dtype=mx.int32), group=group).item())]
