"""A cost model, measured on this machine, that picks the verify width (issue 14).

For each verify width n (tokens fed to one target forward: the last committed token
and n - 1 drafts; n = 1 is plain decoding) it estimates

    rate(n) = expected committed tokens per step / seconds per step

and the engine verifies at the width with the highest rate. Plain decoding is always
a candidate, so speculation is used only when it pays.

- **Seconds**: a target forward of n tokens and a drafter pass, timed once per
  process for a grid of widths (:func:`dflash_mlx.policy.calibrate`), give each
  mode's step estimate (plain: the 1-token forward; chain: the drafter pass plus the
  n-token forward; tree: the same at the tree's width). Every real step refreshes it:
  the step's own wall time (exponential moving average) where that mode and width
  ran lately, else the estimate times the mode's observed/estimated ratio, which
  follows the context as it grows and the loop's own overheads.
- **Committed tokens**: every drafted block is later compared with the tokens the
  target committed at those positions, however many of them were verified, so the
  acceptance of every width up to the block size is observed from each drafted
  block ("shadow" acceptance). At temperature 0 this equals the acceptance the wider
  verify would have had; with sample-and-match it has the same distribution, since
  every committed token is a target sample given the accepted prefix. The estimate
  is the survival function S(i) = P(drafts 1..i all right), exponentially weighted,
  and E[tokens | n] = 1 + sum_{i < n} S(i).
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

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

PLAIN, CHAIN, TREE = "plain", "chain", "tree"
PRIOR = 0.6  # prior per-draft survival (see CostModel.survival)


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
        block_size: B, the drafter's block (widths 1..B).
        decay: weight of the newest observation in every moving average.
        probe_every: plain steps between drafter probes while plain decoding wins.

    Attributes:
        verify_s: ``{n: Ema of seconds}`` for a target forward of n tokens.
        draft_s: Ema of the seconds of one drafter pass.
        survival_num, survival_den: weighted counts behind S(i), i = 1..B-1.
    """

    block_size: int
    decay: float = 0.1
    probe_every: int = 16
    max_probe_every: int = 128
    fresh_steps: int = 64
    verify_s: Dict[int, Ema] = field(default_factory=dict)
    draft_s: Ema = field(default_factory=Ema)
    survival_num: List[float] = field(default_factory=list)
    survival_den: float = 0.0
    pending: List[Pending] = field(default_factory=list)
    since_probe: int = 0
    tree_correction: Dict[int, Ema] = field(default_factory=dict)
    tree_tokens: Dict[int, Ema] = field(default_factory=dict)
    step_s: Dict[Tuple[str, int], Ema] = field(default_factory=dict)
    last_seen: Dict[Tuple[str, int], int] = field(default_factory=dict)
    ratio: Dict[str, Ema] = field(default_factory=dict)
    steps: int = 0
    probe_gap: int = 0
    _known: Optional[list] = None
    _cumulative: Optional[List[float]] = None

    def __post_init__(self):
        self.survival_num = [0.0] * (self.block_size - 1)
        self.draft_s.decay = self.decay
        self.probe_gap = self.probe_every

    # -- kept between processes -----------------------------------------------------

    def state(self) -> dict:
        """What a later process starts from (:class:`~dflash_mlx.calibration.CalibrationStore`):
        the calibrated seconds per width and per drafter pass, each mode's
        observed/estimated ratio, and the acceptance profile (JSON-ready)."""
        return {
            "verify_s": {str(n): e.value for n, e in self.verify_s.items() if e.value is not None},
            "draft_s": self.draft_s.value,
            "ratio": {m: e.value for m, e in self.ratio.items() if e.value is not None},
            "survival_num": list(self.survival_num),
            "survival_den": self.survival_den,
            "tree_tokens": {str(n): e.value for n, e in self.tree_tokens.items() if e.value is not None},
        }

    def restore(self, state: dict, timings: bool = True) -> bool:
        """Start from a stored :meth:`state`: the acceptance profile, and with
        ``timings`` the seconds and ratios. False (nothing changed) when the state does
        not fit this block size or holds a value that is not a finite number >= 0."""
        try:
            num = [float(x) for x in state["survival_num"]]
            den = float(state["survival_den"])
            verify = {int(n): float(t) for n, t in state["verify_s"].items()}
            draft = float(state["draft_s"])
            ratio = {str(m): float(r) for m, r in state.get("ratio", {}).items()}
            trees = {int(n): float(t) for n, t in state.get("tree_tokens", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        numbers = num + [den, draft] + list(verify.values()) + list(ratio.values()) + list(trees.values())
        if len(num) != self.block_size - 1 or not all(math.isfinite(x) and x >= 0 for x in numbers):
            return False
        if timings and (len(verify) < 2 or draft <= 0):
            return False
        self.survival_num, self.survival_den, self._cumulative = num, den, None
        if timings:
            for n, t in verify.items():
                self.record_verify(n, t)
            self.record_draft(draft)
            for m, r in ratio.items():
                self.ratio.setdefault(m, Ema(self.decay)).update(r)
            for n, t in trees.items():
                self.tree_tokens.setdefault(n, Ema(self.decay)).update(t)
        return True

    # -- timing -------------------------------------------------------------------

    def record_verify(self, width: int, seconds: float) -> None:
        """A calibrated target forward of ``width`` tokens took ``seconds`` (real steps
        refresh the estimates through :meth:`record_step`)."""
        self._known = None
        self.verify_s.setdefault(width, Ema(self.decay)).update(seconds)

    def record_draft(self, seconds: float) -> None:
        self.draft_s.update(seconds)

    def estimate(self, mode: str, width: int) -> Optional[float]:
        """Calibrated seconds of one step: the ``width``-token forward, plus the drafter
        pass unless ``mode`` is ``plain`` (None before calibration)."""
        t = self.verify_seconds(width)
        if t is None or mode == PLAIN:
            return t
        return None if self.draft_s.value is None else t + self.draft_s.value

    def record_step(self, mode: str, width: int, seconds: float) -> None:
        """A real step of ``mode`` (``plain``, ``chain``, ``tree``) feeding ``width``
        tokens took ``seconds`` of wall time, drafting included."""
        self.steps += 1
        est = self.estimate(mode, width)
        if est:
            self.ratio.setdefault(mode, Ema(self.decay)).update(seconds / est)
        self.step_s.setdefault((mode, width), Ema(self.decay)).update(seconds)
        self.last_seen[(mode, width)] = self.steps

    def step_seconds(self, mode: str, width: int) -> Optional[float]:
        """Expected seconds of a step: its own recent wall time, else the calibrated
        estimate times the mode's observed/estimated ratio (None before timings)."""
        key = (mode, width)
        if key in self.step_s and self.steps - self.last_seen[key] < self.fresh_steps:
            return self.step_s[key].value
        est = self.estimate(mode, width)
        ratio = self.ratio.get(mode) or next(iter(self.ratio.values()), None)  # else another mode's
        return est * ratio.value if est is not None and ratio is not None else est

    def verify_seconds(self, width: int) -> Optional[float]:
        """Seconds of a forward of ``width`` tokens: piecewise linear between timed
        widths, extended linearly past the ends (None before any timing)."""
        known = self._known
        if known is None:
            known = self._known = sorted((n, e.value) for n, e in self.verify_s.items() if e.value is not None)
        if len(known) < 2:
            return known[0][1] if known else None
        for (n0, t0), (n1, t1) in zip(known, known[1:]):
            if width <= n1 or n1 == known[-1][0]:
                return max(0.0, t0 + (t1 - t0) * (width - n0) / (n1 - n0))
        return None  # unreachable

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
                self._observe(right)
            else:
                still.append(p)
        self.pending = still

    def _observe(self, right: int) -> None:
        """One block whose first ``right`` drafts were right."""
        keep = 1 - self.decay
        self._cumulative = None
        self.survival_den = keep * self.survival_den + 1
        for i in range(len(self.survival_num)):
            hit = 1.0 if i < right else 0.0
            self.survival_num[i] = keep * self.survival_num[i] + hit

    def survival(self) -> List[float]:
        """S(i) for i = 1..B-1: the share of blocks whose drafts 1..i were all right,
        with a prior worth one block of S(i) = 0.6^i: hopeful enough to try
        speculating first, and soon outweighed when drafts miss."""
        den = self.survival_den + 1
        return [(n + PRIOR ** (i + 1)) / den for i, n in enumerate(self.survival_num)]

    def expected_tokens(self, width: int) -> float:
        """E[tokens committed by one verify of ``width`` tokens] = 1 + sum_{i<width} S(i)."""
        if self._cumulative is None:  # per observation, not per call: the loop asks every step
            total, self._cumulative = 1.0, [1.0]
            for x in self.survival():
                total += x
                self._cumulative.append(total)
        return self._cumulative[min(width, self.block_size) - 1]

    # -- choosing -------------------------------------------------------------------

    def rate(self, width: int) -> Optional[float]:
        """Expected committed tokens per second at chain ``width`` (1: plain decoding;
        None before timings)."""
        t = self.step_seconds(PLAIN if width == 1 else CHAIN, width)
        return None if not t else self.expected_tokens(width) / t

    def tree_rate(self, budget: int, expected: float) -> Optional[float]:
        """Tokens per second of a tree of ``budget`` nodes expected to commit ``expected``."""
        t = self.step_seconds(TREE, budget + 1)
        return None if not t else expected / t

    def best_width(self, widths: Optional[Sequence[int]] = None) -> int:
        """The width with the highest expected rate (1 when nothing is timed yet)."""
        widths = widths or range(1, self.block_size + 1)
        rates = [(r, n) for n in widths if (r := self.rate(n)) is not None]
        return max(rates)[1] if rates else 1

    def should_probe(self) -> bool:
        """While plain decoding wins: True after ``probe_every`` plain steps, then
        after twice as many, up to ``max_probe_every`` (see :meth:`speculating`)."""
        self.since_probe += 1
        if self.since_probe >= self.probe_gap:
            self.since_probe = 0
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_every)
            return True
        return False

    def speculating(self) -> None:
        """Speculation was chosen: probes restart at ``probe_every`` when plain wins again."""
        self.since_probe, self.probe_gap = 0, self.probe_every

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
