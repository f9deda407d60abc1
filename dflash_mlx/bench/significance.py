"""Whether one engine beats another over repeated runs, with no assumption on the noise."""

from __future__ import annotations

from math import comb
from typing import Iterable


def sign_test(ratios: Iterable[float]) -> dict:
    """One-sided exact sign test that paired ratios (ours / a baseline, one per independent repeat)
    are above 1 more often than chance; ratios of exactly 1 are dropped.

    Returns:
        ``{"above": count above 1, "n": count, "p": P(at least "above" heads in "n" fair flips)}``,
        p = 1.0 when n = 0.
    """
    signs = [r > 1.0 for r in ratios if r != 1.0]
    n, above = len(signs), sum(signs)
    p = sum(comb(n, k) for k in range(above, n + 1)) / 2**n if n else 1.0
    return {"above": above, "n": n, "p": p}
