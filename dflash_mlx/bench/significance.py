"""Whether one engine beats another over repeated runs, without assuming how the noise is distributed."""

from __future__ import annotations

from math import comb
from typing import Iterable


def sign_test(ratios: Iterable[float]) -> dict:
    """One-sided exact sign test that paired ratios (ours / a baseline, one per repeat
    run under the same conditions) are above 1 more often than chance.

    Args:
        ratios: per repeat, ours over the baseline (ratios of exactly 1 are dropped).

    Returns:
        ``{"above": repeats above 1, "n": repeats counted, "p": P(at least "above" of
        "n" fair coin flips come up heads)}``; p = 1.0 when n = 0. Makes no assumption
        about the noise's distribution (a CPU's bimodal speed states), only that the
        repeats are independent.
    """
    signs = [r > 1.0 for r in ratios if r != 1.0]
    n, above = len(signs), sum(signs)
    p = sum(comb(n, k) for k in range(above, n + 1)) / 2**n if n else 1.0
    return {"above": above, "n": n, "p": p}
