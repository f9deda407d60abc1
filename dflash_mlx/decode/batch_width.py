"""``--block-size auto`` for a batch: one verify width per batched step (issue 21).

One request at a time, auto chooses each step's width from a calibrated cost model
(:mod:`dflash_mlx.decode.cost`). A batch shares one target forward, so it shares one
width: the width w (a block size the drafter drafts, 2..its trained size) that
maximises

    rate(w, N) = N * E[tokens | w] / seconds(w, N)

for the N sequences active now. Width 1 is a plain step: every sequence's last token
alone, no drafts (E[tokens | 1] = 1), its context rows kept for the next draft. On a
backend where a batched verify costs about its width in plain steps (MLX's CPU: issue 21)
a full batch with poor drafts runs plain steps, and every ``wide_every``-th step is
width 2, so the drafts' acceptance stays known.

- **E[tokens | w]** = 1 + sum_{i < w} S(i), S(i) the pooled survival of drafts 1..i
  (every sequence's every block counts, exponentially weighted): a block verified at
  w shows positions 1..a right and a + 1 wrong, or is censored at w - 1 (Kaplan-Meier,
  as in the one-request model). Positions past the widths in use are learned from a
  wider step every ``wide_every`` steps; until seen they take the prior.
- **seconds(w, N)**: what whole batched steps of w took with N sequences, measured on
  this machine (an exponentially weighted mean per (w, N); a cell counts once run twice,
  since the first run of a new shape pays for its setup and is not kept). Each width is
  first run at the first batch size seen. A (w, N) not yet timed is estimated from w
  at the nearest timed batch size M, scaled by t(v, N) / t(v, M) of a width v timed at
  both (requests join and leave all the time: timing every width at every N would
  spend many steps on widths that lose). A step more than three times off its mean is
  a pause, not a timing.

Timings come from ``clock`` (injectable: tests give fixed seconds; nothing here decides
what a test checks from the wall clock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

PRIOR = 0.6  # conditional acceptance of a draft position never verified
OUTLIER = 3.0  # a step this many times off its mean is not counted


def block_widths(trained: int) -> List[int]:
    """The widths a batch chooses among: 1 (a plain step), 2, 4, 8, ... below the
    trained size, and it.

    Args:
        trained: the drafter's trained block size (>= 2).
    """
    widths, w = [1], 2
    while w < trained:
        widths.append(w)
        w *= 2
    return widths + [trained]


@dataclass
class BatchWidths:
    """Chooses the width of each batched step and learns from what the steps did.

    Args:
        trained: the drafter's trained block size; the widest choice.
        clock: seconds, monotonic (default ``time.perf_counter``).
        decay: weight of the newest step in each (w, N) timing mean.
        acceptance_decay: weight of the newest block in the acceptance profile.
        wide_every: steps between two steps one width wider than the best (so the
            acceptance of wider blocks stays known).

    Attributes:
        widths: the candidate widths (:func:`block_widths`).
        seconds: ``{(w, N): mean seconds of a whole step}``.
        runs: ``{(w, N): steps run}`` (the first one's seconds are dropped).
        tried, right: weighted counts per draft position i = 1..trained-1 (index i-1).
        steps: batched steps observed.
    """

    trained: int
    clock: Callable[[], float] = time.perf_counter
    decay: float = 0.2
    acceptance_decay: float = 0.02
    wide_every: int = 8
    widths: List[int] = field(init=False)
    seconds: Dict[Tuple[int, int], float] = field(default_factory=dict)
    runs: Dict[Tuple[int, int], int] = field(default_factory=dict)
    tried: List[float] = field(init=False)
    right: List[float] = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.widths = block_widths(self.trained)
        self.tried = [0.0] * (self.trained - 1)
        self.right = [0.0] * (self.trained - 1)

    def survival(self) -> List[float]:
        """S(i) for i = 1..trained-1: the chance drafts 1..i are all right."""
        out, s = [], 1.0
        for tried, right in zip(self.tried, self.right):
            s *= (right + PRIOR) / (tried + 1.0)
            out.append(s)
        return out

    def expected_tokens(self, width: int) -> float:
        """E[tokens committed per sequence | a step of ``width``] = 1 + sum_{i < w} S(i)."""
        return 1.0 + sum(self.survival()[: width - 1])

    def timed(self, width: int, n: int) -> bool:
        """Whether steps of ``width`` with ``n`` sequences have a measured mean."""
        return self.runs.get((width, n), 0) >= 2

    def estimate(self, width: int, n: int) -> float | None:
        """Seconds of a step of ``width`` with ``n`` sequences: measured, or scaled from
        the nearest batch size it was measured at; None if ``width`` was never timed."""
        if self.timed(width, n):
            return self.seconds[(width, n)]
        sizes = [m for (w, m) in self.seconds if w == width and self.timed(w, m)]
        if not sizes:
            return None
        m = min(sizes, key=lambda s: (abs(s - n), s))
        scale = next((self.seconds[(v, n)] / self.seconds[(v, m)] for v in self.widths
                      if self.timed(v, n) and self.timed(v, m)), 1.0)
        return self.seconds[(width, m)] * scale

    def choose(self, n: int) -> int:
        """The width of the next step with ``n`` active sequences (n >= 1)."""
        untimed = [w for w in self.widths if self.estimate(w, n) is None]
        if untimed:
            return untimed[0]
        best = max(self.widths, key=lambda w: n * self.expected_tokens(w) / self.estimate(w, n))
        if self.steps % self.wide_every == self.wide_every - 1 and best != self.widths[-1]:
            return self.widths[self.widths.index(best) + 1]
        return best

    def start(self) -> float:
        """Call before a step; pass the result to :meth:`observe`."""
        return self.clock()

    def observe(self, started: float, width: int, accepted: Sequence[int]) -> None:
        """Learn from a finished step: its seconds and each sequence's accepted drafts.

        Args:
            started: :meth:`start`'s value for this step.
            width: the step's width w.
            accepted: per sequence, drafts accepted (0..w-1; 0 in a plain step).
        """
        seconds, key = self.clock() - started, (width, len(accepted))
        runs = self.runs.get(key, 0)
        self.runs[key] = runs + 1
        if runs == 1:
            self.seconds[key] = seconds  # the first run was setup; the second sets the mean
        elif runs > 1:
            mean = self.seconds[key]
            if mean / OUTLIER <= seconds <= mean * OUTLIER:
                self.seconds[key] = (1 - self.decay) * mean + self.decay * seconds
        keep = (1 - self.acceptance_decay) ** len(accepted)
        self.tried = [t * keep for t in self.tried]
        self.right = [r * keep for r in self.right]
        for a in accepted:
            for i in range(min(a + 1, width - 1)):  # positions 1..a right, a + 1 wrong (if drafted)
                self.tried[i] += 1.0
                self.right[i] += 1.0 if i < a else 0.0
        self.steps += 1
