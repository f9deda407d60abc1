"""The one range check of a numeric setting: every flag and config value goes through :func:`check_number`."""

import math
from typing import Optional

from .errors import InputError


def check_number(flag: str, value, at_least=None, at_most=None, above=None, rule: Optional[str] = None) -> None:
    """Refuse ``value`` outside its range, with one line naming ``flag``.

    Args:
        flag: the flag (``--grad-accum``) or command (``/temp``) the value came from.
        value: an int or float; None (an optional flag not given) passes.
        at_least, at_most: inclusive bounds; ``above``: an exclusive lower bound.
        rule: the allowed range in words, when the bounds alone would mislead
            (e.g. "0 (all samples) or more").

    Raises:
        InputError: ``"{flag} must be {rule}, got {value}"``; NaN and infinities are
            always refused, as ``"{flag} must be a finite number, got nan"``.
    """
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{flag} must be a finite number, got {value}")
    low_ok = (at_least is None or value >= at_least) and (above is None or value > above)
    if low_ok and (at_most is None or value <= at_most):
        return
    raise InputError(f"{flag} must be {rule or _rule(value, at_least, at_most, above)}, got {value}")


def _rule(value, at_least, at_most, above) -> str:
    """The range in words: ``at least 1``, ``>= 0``, ``> 0``, ``in 1..256``, ``in (0, 1]``."""
    real = isinstance(value, float)
    if at_most is None:
        if above is not None:
            return f"> {above}"
        return f">= {at_least}" if real else f"at least {at_least}"
    if above is not None:
        return f"in ({above}, {at_most}]"
    if at_least is None:
        return f"<= {at_most}" if real else f"at most {at_most}"
    return f"in [{at_least}, {at_most}]" if real else f"in {at_least}..{at_most}"
