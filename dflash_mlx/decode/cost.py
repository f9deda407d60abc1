# Over 400 lines: one cost model and its fitting, read together
"""A cost model, measured on this machine, that picks each step's verify (issues 14, 19).

For each chain width n (tokens fed to one target forward: the last committed token
and n - 1 drafts; n = 1 is plain decoding) it estimates

    rate(n) = expected committed tokens per step / seconds per step

and the engine runs the width with the highest rate. Plain decoding is always a
candidate, so speculation is used only when it pays.

- **Drafted block**: a chain of n is drafted at D, the smallest timed block size
  >= n (2, 4, 8, 16, ..., the trained size): drafting 16 to verify 6 would pay for
  ten drafts nobody checks. Its step costs D's timed step: verifying fewer of the
  drafts saves too little to measure (on a CPU, BLAS takes rows in groups), so the
  best chain is a whole timed block. Every ``wide_every`` chain steps drafted below the
  trained size, one drafts the next block size up instead (a wide probe), so what
  wider verifies would accept stays known.
- **Seconds**: a whole plain step (in a pipelined run) and a whole chain step of
  each timed width (drafted at its block, the verify built while the drafter runs),
  as the loop runs them, and a target forward of each width and a drafter pass at
  each block size, all timed at two context lengths (:mod:`dflash_mlx.decode.calibration`),
  give each step's estimate at the current context: plain and chain from the whole
  steps, tree from the forward of its nodes plus a pass at the trained size. Every
  real step's time drafting and verifying refreshes one factor, the machine's speed,
  shared by every mode (a busy spell slows plain and speculative estimates alike, so
  it does not push the choice either way). What the calibration got wrong between
  widths is learned where widths meet: the first step of a timed width after a step
  of another (a switch) is compared with the speed the other just showed, and that
  width's own factor moves toward the ratio; within a run of one width only the
  speed moves. Trees, estimated from parts, learn their own factor over the speed.
  Apart, each mode's overhead per step (planning, bookkeeping). A step more than
  three times off its estimate (a pause) is not counted, nor, for its factor, a
  width's first step in a process (its first run compiles).
- **Committed tokens**: every drafted block is later compared with the tokens the
  target committed at its positions, however many of them were verified, so the
  acceptance of every width up to the block drafted is observed ("shadow"
  acceptance). At temperature 0 this equals the acceptance the wider verify would
  have had; with sample-and-match it has the same distribution, since every
  committed token is a target sample given the accepted prefix. The estimate is the
  survival function S(i) = P(drafts 1..i all right), a product of per-position
  conditional acceptances (Kaplan-Meier: a block drafted short is censored where it
  ends), exponentially weighted, with E[tokens | n] = 1 + sum_{i < n} S(i).
  Blocks of every size count alike: the first drafts of a block of 8 are as good as
  those of a block of 16 (drafters trained at several block sizes, as
  ``dflash train --block-sizes`` does, measure so; and it is what the drafts are
  judged by, so a drafter for which it is false is seen drafting worse and used less).
- **Plain decoding** observes no drafts, so while it is chosen the drafter is run
  now and then (a probe: its drafts are compared with the plain tokens that follow);
  when the estimate says speculation pays again, the engine goes back to it. Probes
  that find speculation still losing space out (16, 32, ... up to 128 plain steps),
  so a drafter that does not fit the text costs a few percent at most.
- **Trees** (DDTree, spec section 7): a tree's expected tokens are the drafter's path
  probabilities, calibrated per depth against the chain's observed acceptance, and
  corrected by the tree's own observed acceptance.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .calibration import Calibration

PLAIN, CHAIN, TREE = "plain", "chain", "tree"
PRIOR = 0.6  # prior conditional acceptance of a draft, before any block (see CostModel.survival)
FACTOR_DECAY = 0.05  # a step's factor over the machine's speed changes slowly
SWITCH_WEIGHT = 0.3  # weight of one comparison at a switch of widths in that width's factor
PLAIN_RUN_STEPS = 8  # a plain run this long teaches its factor even in its first run (its compile is spread thin)
RESTORED_BLOCKS = 6.0  # weight, in blocks, a kept acceptance profile falls to when this run's text differs
SURPRISE_BLOCKS, SURPRISE = 6, 0.05  # ... judged by the first drafts of the first blocks: this unlikely under it
OUTLIER = 3.0  # a step more than this many times off its estimate is not a timing (a first compile, a pause)


@dataclass
class Ema:
    """An exponentially weighted mean; ``value`` is None until the first update."""

    decay: float = 0.1
    value: Optional[float] = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.decay) * self.value + self.decay * x
        return self.value


@dataclass
class Pending:
    """A drafted block waiting for the target's tokens at its positions."""

    start: int  # absolute position of the first draft
    drafts: List[int]


@dataclass
class CostModel:
    """Chooses the verify width that maximises expected committed tokens per second.

    Args:
        block_size: B, the drafter's trained block (widths 1..B).
        decay: weight of the newest observation in every timing average.
        acceptance_decay: weight of the newest block in the acceptance profile (its
            memory is longer: acceptance comes in bursts, and a profile that follows
            every burst would give up speculating on the first bad run of text).
        probe_every: plain steps before the first probe (a plain step that also
            drafts) while plain decoding wins.
        max_probe_every: the longest gap between probes while plain decoding wins.
        wide_every: chain steps drafted below the trained size between two drafted
            one block size wider (:meth:`probe_block`).

    Attributes:
        calibration: the seconds of forwards and drafts (None until :meth:`calibrate`).
        speed: observed over estimated seconds of recent steps, whatever their mode
            (a busy machine slows every mode alike).
        mode_factor: ``{"tree": Ema}`` what tree steps took over their estimate (a
            forward and a draft timed apart) at that speed, learned slowly; plain and
            chain steps were timed whole, as the loop runs them.
        width_factor: ``{D: Ema}`` what steps of a timed width (1: plain; D: a chain
            drafted at block D) took over their estimate at that speed, learned at
            switches between widths (see the module doc); 1.0 until one is seen.
        overhead: ``{mode: Ema}`` seconds a step of that mode spends outside drafting
            and verifying (planning, bookkeeping), the same at every width.
        tried, right: weighted counts per position i = 1..B-1: blocks whose drafts
            1..i-1 were right that drafted an i-th, and those whose i-th was right
            too; their ratio is the conditional acceptance behind S(i).
    """

    block_size: int
    decay: float = 0.1
    acceptance_decay: float = 0.05
    probe_every: int = 16
    wide_every: int = 8
    max_probe_every: int = 128
    calibration: Optional[Calibration] = None
    speed: Ema = field(default_factory=lambda: Ema(0.1, 1.0))
    mode_factor: Dict[str, Ema] = field(default_factory=dict)
    width_factor: Dict[int, Ema] = field(default_factory=dict)
    last_width: Optional[int] = None  # the timed width of the last plain or chain step
    seen_widths: set = field(default_factory=set)  # timed widths stepped in this process
    overhead: Dict[str, Ema] = field(default_factory=dict)
    tried: List[float] = field(default_factory=list)
    right: List[float] = field(default_factory=list)
    pending: List[Pending] = field(default_factory=list)
    since_probe: int = 0
    since_wide: int = 0
    probe_gap: int = 0
    first_hits: Optional[List[float]] = None  # chances of this run's first blocks' first drafts, after a restore
    restored_c1: float = 0.0  # the restored profile's share of first drafts right
    tree_correction: Dict[int, Ema] = field(default_factory=dict)
    tree_tokens: Dict[int, Ema] = field(default_factory=dict)
    steps: int = 0
    _cumulative: Optional[List[float]] = None
    _tables: Optional[tuple] = None
    _block_sizes: Optional[List[int]] = None

    def __post_init__(self):
        self.tried = [0.0] * (self.block_size - 1)
        self.right = [0.0] * (self.block_size - 1)
        self.probe_gap = self.probe_every

    # -- kept between processes -----------------------------------------------------

    def state(self) -> dict:
        """What a later process starts from (:class:`~dflash_mlx.decode.calibration.CalibrationStore`):
        the calibration, each mode's observed/estimated ratio, the acceptance
        profile, and the gap between probes while plain decoding wins (JSON-ready)."""
        return {
            "calibration": self.calibration.to_dict() if self.calibration else None,
            "speed": self.speed.value,
            "mode_factor": {m: e.value for m, e in self.mode_factor.items()},
            "width_factor": {str(w): e.value for w, e in self.width_factor.items()},
            "overhead": {m: e.value for m, e in self.overhead.items()},
            "tried": list(self.tried),
            "right": list(self.right),
            "tree_tokens": {str(n): e.value for n, e in self.tree_tokens.items() if e.value is not None},
            "probe_gap": self.probe_gap,
        }

    def restore(self, state: dict, timings: bool = True) -> bool:
        """Start from a stored :meth:`state`: the acceptance profile, and with
        ``timings`` the calibration and ratios. False (nothing changed) when the
        state does not fit this block size or holds a value that is not a finite
        number >= 0."""
        try:
            tried = [float(x) for x in state["tried"]]
            right = [float(x) for x in state["right"]]
            ratio = {str(m): float(r) for m, r in state.get("mode_factor", {}).items()}
            widths = {int(w): float(r) for w, r in state.get("width_factor", {}).items()}
            speed = float(state.get("speed", 1.0))
            overhead = {str(m): float(o) for m, o in state.get("overhead", {}).items()}
            trees = {int(n): float(t) for n, t in state.get("tree_tokens", {}).items()}
            calibration = Calibration.from_dict(state["calibration"]) if timings else None
            gap = int(state.get("probe_gap", self.probe_every))
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        numbers = tried + right + list(ratio.values()) + list(trees.values()) + list(overhead.values()) + [speed]
        if len(tried) != self.block_size - 1 or len(right) != len(tried) \
                or not all(math.isfinite(x) and x >= 0 for x in numbers) \
                or not all(math.isfinite(r) and r > 0 for r in widths.values()):
            return False
        # the earlier runs' profile is kept whole, unless this run's first blocks say its
        # text suits the drafter much better or worse (stories after math): see _surprise
        self.tried, self.right, self._cumulative = tried, right, None
        self.first_hits = [] if tried[0] > RESTORED_BLOCKS else None
        self.restored_c1 = right[0] / tried[0] if tried[0] else 0.0
        # a pair that decoded plainly before starts with probes sparser than at first
        self.probe_gap = min(max(gap, self.probe_every), self.max_probe_every // 4)
        if timings:
            self.calibrate(calibration)
            self.speed = Ema(self.decay, speed)
            for m, r in ratio.items():
                self.mode_factor[m] = Ema(FACTOR_DECAY, r)
            for w, r in widths.items():
                self.width_factor[w] = Ema(SWITCH_WEIGHT, r)
            for m, o in overhead.items():
                self.overhead[m] = Ema(self.decay, o)
            for n, t in trees.items():
                self.tree_tokens[n] = Ema(self.decay, t)
        return True

    # -- seconds --------------------------------------------------------------------

    def calibrate(self, calibration: Calibration) -> None:
        """Take the seconds of forwards and drafts (see :mod:`dflash_mlx.decode.calibration`)."""
        self.calibration = calibration.capped()
        self._tables = self._block_sizes = None

    def draft_block(self, width: int) -> int:
        """D, the block a chain of ``width`` is drafted at: the smallest timed block
        size >= width (the trained size before calibration)."""
        blocks = self._blocks()
        return blocks[bisect.bisect_left(blocks, min(width, self.block_size))]

    def _table(self) -> Tuple[List[float], ...]:
        """Forward, draft and chain seconds per size at both contexts, interpolated
        once (the loop asks for every width every step)."""
        if self._tables is None:
            cal = self.calibration
            c0, c1 = cal.contexts
            top = max(max(cal.verify_s), self.block_size)
            tables = []
            for lookup, sizes in ((cal.forward, top), (cal.draft, self.block_size), (cal.chain, self.block_size)):
                tables += [[lookup(n, c) for n in range(sizes + 1)] for c in (c0, c1)]
            self._tables = tuple(tables)
        return self._tables

    def estimate(self, mode: str, width: int, context: int, block: Optional[int] = None) -> Optional[float]:
        """Calibrated seconds of one step after ``context`` tokens (None before
        calibration): plain, a step of a pipelined plain run (with a ``block``: a
        probe, which drafts that block too); chain, the timed chain step of
        ``width`` (a ``block`` wider than :meth:`draft_block` adds its extra drafting);
        tree, the forward of ``width`` tokens and a pass at the trained size."""
        if self.calibration is None:
            return None
        return self._seconds(mode, width, block, self._context_weight(context))

    def _context_weight(self, context: int) -> float:
        c0, c1 = self.calibration.contexts
        return (context - c0) / (c1 - c0)

    def _seconds(self, mode: str, width: int, block: Optional[int], w: float) -> float:
        """:meth:`estimate` with ``w`` where the context lies between the two timed ones."""
        f0, f1, d0, d1, s0, s1 = self._table()
        at = lambda t0, t1, i: max(t0[i] + (t1[i] - t0[i]) * w, 0.5 * t0[i])  # noqa: E731
        if mode == PLAIN:
            return at(s0, s1, 1) + (at(d0, d1, min(block, self.block_size)) if block else 0.0)
        if mode == TREE:
            return at(f0, f1, min(width, len(f0) - 1)) + at(d0, d1, self.block_size)
        own = self.draft_block(min(width, self.block_size))
        # The timed chain step of its block: verifying fewer of the drafted tokens is
        # taken to save nothing. Between timed widths a forward's cost is not linear
        # (on a CPU, BLAS kernels take rows in groups), and interpolating it let widths
        # just under a timed one look as fast per token as the whole block while being
        # slower (stories260K: auto at widths 5-7, 0.93x of B=8).
        t = at(s0, s1, own)
        if block is not None and block > own:  # a wide probe drafts more than the chain needs
            t += at(d0, d1, min(block, self.block_size)) - at(d0, d1, own)
        return t

    def record_step(self, mode: str, width: int, seconds: float, context: int, block: Optional[int] = None,
                    overhead: float = 0.0, steps: int = 1) -> None:
        """A real step of ``mode`` (``plain``, ``chain``, ``tree``) feeding ``width``
        tokens after ``context`` tokens, drafted at ``block`` (plain: a probe), took ``seconds`` to draft
        and verify, and a step of this mode ``overhead`` seconds besides (planning,
        bookkeeping: the same whatever the width); ``steps``: how many steps of a
        plain run ``seconds`` is the mean of (a first step's compiling is spread thin
        over many)."""
        self.steps += 1
        self.overhead.setdefault(mode, Ema(self.decay, overhead)).update(overhead)
        est = self.estimate(mode, width, context, block)
        if not est or not 1 / OUTLIER < seconds / est < OUTLIER:  # a first compile of a shape, a pause
            return
        q = seconds / est
        timed = self._timed_width(mode, width, block)
        if timed is not None and timed != self.last_width and self.last_width is not None \
                and (timed in self.seen_widths or steps >= PLAIN_RUN_STEPS):  # a switch: against the speed the other just showed
            self.width_factor.setdefault(timed, Ema(SWITCH_WEIGHT, 1.0)).update(q / self.speed.value)
        self.speed.update(q / self._factor(mode, width))
        if timed is not None:
            self.last_width = timed
            self.seen_widths.add(timed)
        if mode == TREE:  # plain and chain steps were timed whole, as the loop runs them; a tree from its parts
            self.mode_factor.setdefault(mode, Ema(FACTOR_DECAY, 1.0)).update(q / self.speed.value)

    def step_seconds(self, mode: str, width: int, context: int) -> Optional[float]:
        """Expected seconds of a step after ``context`` tokens: the estimate times the
        machine's current speed and the mode's factor, plus the mode's overhead (None
        before calibration)."""
        est = self.estimate(mode, width, context)
        if est is None:
            return None
        return est * self.speed.value * self._factor(mode, width) + self._overhead(mode)

    def _timed_width(self, mode: str, width: int, block: Optional[int] = None) -> Optional[int]:
        """The timed step a plain or chain step is estimated from (1, or its draft
        block D); None for trees and probes (a probe drafts too: it tells the speed only)."""
        if mode == PLAIN:
            return None if block else 1
        return self.draft_block(min(width, self.block_size)) if mode == CHAIN else None

    def _factor(self, mode: str, width: int = 1) -> float:
        if mode == TREE:
            f = self.mode_factor.get(mode)
        else:
            f = self.width_factor.get(self._timed_width(mode, width))
        return f.value if f is not None else 1.0

    def _overhead(self, mode: str) -> float:
        o = self.overhead.get(mode) or self.overhead.get(CHAIN)  # a plain step has no more to do than a chain
        return o.value if o is not None else 0.0

    # -- acceptance -----------------------------------------------------------------

    def record_drafts(self, start: int, drafts: Sequence[int]) -> None:
        """A drafter pass proposed ``drafts`` for positions ``start, start+1, ...``."""
        self.pending.append(Pending(start, list(drafts)))

    def record_committed(self, committed: Sequence[int], offset: int) -> None:
        """Tokens committed so far: ``committed[i]`` sits at position ``offset + i``.
        Resolves every pending block whose outcome is now known."""
        still = []
        end = offset + len(committed)
        for p in self.pending:
            right, known = 0, True
            for k, d in enumerate(p.drafts):
                if p.start + k >= end:  # not committed yet: wait
                    known = False
                    break
                if committed[p.start + k - offset] != d:  # first wrong draft: resolved
                    break
                right += 1
            if known:
                self._observe(right, len(p.drafts))
            else:
                still.append(p)
        self.pending = still

    def _surprise(self, right: int) -> None:
        """While a restored profile is on trial (the run's first
        :data:`SURPRISE_BLOCKS` blocks): once the first drafts seen so far (right or
        wrong) had a chance below :data:`SURPRISE` under the profile, it is scaled down
        to :data:`RESTORED_BLOCKS` blocks, so this run's text takes over quickly (one
        right first draft is enough against a profile that never saw one)."""
        c1 = min(max(self.restored_c1, 0.02), 0.98)
        self.first_hits.append(c1 if right > 0 else 1.0 - c1)
        if math.prod(self.first_hits) < SURPRISE:
            scale = RESTORED_BLOCKS / self.tried[0]
            self.tried, self.right = [scale * x for x in self.tried], [scale * x for x in self.right]
            self.first_hits = None
        elif len(self.first_hits) >= SURPRISE_BLOCKS:
            self.first_hits = None

    def _observe(self, right: int, drafted: int) -> None:
        """One block of ``drafted`` drafts whose first ``right`` were right: it tried
        positions 1..min(right + 1, drafted) (a block that ran out of drafts is
        censored there), and was right at the first ``right``."""
        if self.first_hits is not None:
            self._surprise(right)
        if right > self.expected_tokens(drafted + 1) - 1:  # better than expected: while plain wins, probe soon
            self.probe_gap = self.probe_every
        keep = 1 - self.acceptance_decay
        self._cumulative = None
        for i in range(min(right + 1, drafted, len(self.tried))):
            self.tried[i] = keep * self.tried[i] + 1
            self.right[i] = keep * self.right[i] + (i < right)

    def survival(self) -> List[float]:
        """S(i) for i = 1..B-1: P(drafts 1..i all right), the product of the
        conditional acceptances c(j) = P(draft j right | drafts before it right).
        c(1) is estimated with a prior worth one block of the conditional acceptance
        of all positions pooled (itself from a prior of 0.6 worth one block: hopeful
        enough to try speculating first, soon outweighed when drafts miss); each later
        c(j) with a prior worth one block of c(j-1): a position few blocks reached
        (those drafted wider, or rare long runs) leans on the one before it, so
        estimates of wide verifies neither sink for want of samples nor take the
        average of positions far from it (on math text the first draft is right a
        quarter of the time and the later ones, given that, half)."""
        prior = (sum(self.right) + PRIOR) / (sum(self.tried) + 1)
        out, s = [], 1.0
        for t, r in zip(self.tried, self.right):
            prior = (r + prior) / (t + 1)
            s *= prior
            out.append(s)
        return out

    def _blocks(self) -> List[int]:
        """Block sizes a chain may be drafted at: the timed ones from 2 to B, and B."""
        if self._block_sizes is None:
            timed = self.calibration.draft_s if self.calibration is not None else ()
            self._block_sizes = sorted({b for b in timed if 2 <= b <= self.block_size} | {self.block_size})
        return self._block_sizes

    def expected_tokens(self, width: int) -> float:
        """E[tokens committed by one verify of ``width`` tokens] = 1 + sum_{i<width} S(i)."""
        if self._cumulative is None:  # per observation, not per call: the loop asks every step
            total, self._cumulative = 1.0, [1.0]
            for x in self.survival():
                total += x
                self._cumulative.append(total)
        return self._cumulative[min(width, self.block_size) - 1]

    # -- choosing -------------------------------------------------------------------

    def rate(self, width: int, context: int = 0) -> Optional[float]:
        """Expected committed tokens per second at chain ``width`` (1: plain decoding)
        after ``context`` tokens; None before calibration."""
        t = self.step_seconds(PLAIN if width == 1 else CHAIN, width, context)
        return None if not t else self.expected_tokens(width) / t

    def tree_rate(self, budget: int, expected: float, context: int = 0) -> Optional[float]:
        """Tokens per second of a tree of ``budget`` nodes expected to commit ``expected``."""
        t = self.step_seconds(TREE, budget + 1, context)
        return None if not t else expected / t

    def best_width(self, widths: Optional[Sequence[int]] = None, context: int = 0) -> int:
        """The width with the highest expected rate (1 when nothing is timed yet)."""
        return self.best_rate(widths or range(1, self.block_size + 1), context)[0]

    def best_rate(self, widths: Sequence[int], context: int = 0) -> Tuple[int, float]:
        """``(width, expected tokens per second)`` of the best of ``widths`` ((1, 0.0)
        when nothing is timed yet). One pass over the widths: the loop asks before
        every step."""
        if self.calibration is None:
            return 1, 0.0
        w = self._context_weight(context)
        self.expected_tokens(1)  # fills the cumulative sums
        overheads = {m: self._overhead(m) for m in (PLAIN, CHAIN)}
        best, best_rate = 1, -1.0
        for n in widths:
            mode = PLAIN if n == 1 else CHAIN
            factor = self.speed.value * self._factor(mode, n)
            rate = self._cumulative[min(n, self.block_size) - 1] / (self._seconds(mode, n, None, w) * factor
                                                                    + overheads[mode])
            if rate > best_rate:
                best, best_rate = n, rate
        return best, best_rate

    def plain_steps_before_probe(self) -> int:
        """While plain decoding wins: plain steps left before the next probe is due
        (0: now). Probes come after ``probe_every`` plain steps, then after twice as
        many, up to ``max_probe_every``, until speculation is chosen again or a block
        does better than expected (see :meth:`probed`, :meth:`speculating`)."""
        return max(self.probe_gap - 1 - self.since_probe, 0)

    def probed(self, close: bool = False) -> None:
        """A probe runs now; the next comes twice as far, unless plain decoding wins
        by little (``close``)."""
        self.since_probe = 0
        if not close:
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_every)

    def speculating(self) -> None:
        """Speculation was chosen: probes restart at ``probe_every`` when plain wins again."""
        self.since_probe, self.probe_gap = 0, self.probe_every

    def probe_block(self, block: int) -> int:
        """The block a chain drafted at ``block`` drafts this step: every
        ``wide_every``-th such step, the next timed size up (what wider verifies would
        accept stays known: the positions past a block are seen only this way),
        else ``block``."""
        if block >= self.block_size:
            return block
        self.since_wide += 1
        if self.since_wide < self.wide_every:
            return block
        self.since_wide = 0
        return next(b for b in self._blocks() if b > block)

    # -- trees ----------------------------------------------------------------------

    def tree_expected_tokens(self, budget: int, depth_probs: Sequence[Tuple[int, float]],
                             chain_probs: Sequence[float]) -> float:
        """Expected tokens committed by a tree verify.

        Args:
            budget: the tree's node count N.
            depth_probs: per node, ``(depth, drafter path probability)``.
            chain_probs: the drafter's top-1 path probability per depth 1..B-1 for
                this block, to calibrate: depth i's probabilities are scaled by
                S(i) / chain_probs[i-1], so the top-1 chain predicts what the chain
                actually accepts.
        """
        surv = self.survival()
        total = 1.0
        for depth, p in depth_probs:
            c = chain_probs[depth - 1]
            scale = surv[depth - 1] / c if c > 0 else 0.0
            total += min(1.0, p * scale)
        correction = self.tree_correction.get(budget)
        return total * (correction.value if correction and correction.value else 1.0)

    def record_tree(self, budget: int, predicted: float, observed: float) -> None:
        """A tree of ``budget`` nodes predicted ``predicted`` tokens and committed ``observed``."""
        self.tree_tokens.setdefault(budget, Ema(self.decay)).update(observed)
        if predicted > 0:
            self.tree_correction.setdefault(budget, Ema(self.decay)).update(observed / predicted)
