"""Where a generation ends: a stop token, a stop string, or the token budget.

The decode loop hands every run of tokens it is about to commit (one verify's
``a + 1`` tokens) to :meth:`StopCondition.cut`, which keeps the tokens up to the
first stop and says why it stopped, so a block is cut at its first stop token or
stop string and the caches can be settled to exactly what was committed.

Stop strings are matched on decoded text, as the OpenAI API defines them. mlx-lm's
``StopSequences`` matches the stop word's own token ids instead, which misses a stop
string that the tokenizer spells with other tokens in context (``"\\n\\n"`` merged
into one token, a word-initial space), so this small matcher is our own.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

Decode = Callable[[List[int]], str]


class StopCondition:
    """Cuts runs of committed tokens at a stop token, a stop string or ``max_tokens``.

    Args:
        max_tokens: most tokens to emit (>= 1).
        stop_token_ids: ids that end generation; the stop token is not emitted.
        stop_strings: texts that end generation; the token that completes a stop
            string is emitted (text consumers cut the text at the match, see
            :func:`text_before_stop`).
        decode: token ids -> text (the tokenizer's ``decode``); needed with
            ``stop_strings``.

    Attributes:
        emitted: tokens emitted so far.

    Raises:
        ValueError: stop strings without ``decode``, or an empty stop string.
    """

    def __init__(self, max_tokens: int, stop_token_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), decode: Optional[Decode] = None):
        if stop_strings and decode is None:
            raise ValueError("stop strings need a decode function (the tokenizer's)")
        if any(not s for s in stop_strings):
            raise ValueError("a stop string must not be empty")
        self.max_tokens = max_tokens
        self.stop_ids = set(stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.emitted = 0
        # Tokens of left context that can hold the start of a stop string: a token
        # decodes to at least one character almost always; the margin covers the rest.
        self._window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4
        self._tail: List[int] = []

    @property
    def budget(self) -> int:
        """Tokens that may still be emitted."""
        return self.max_tokens - self.emitted

    def cut(self, tokens: Sequence[int]) -> Tuple[List[int], Optional[str]]:
        """Keep ``tokens`` up to the first stop; count them as emitted.

        Returns:
            ``(kept, finish_reason)``: finish_reason is ``"stop"`` (stop token or
            stop string), ``"length"`` (the budget is reached) or None.
        """
        kept, reason = list(tokens[: self.budget]), None
        for i, tok in enumerate(kept):
            if tok in self.stop_ids:
                kept, reason = kept[:i], "stop"
                break
        end = self._stop_string_end(kept)
        if end is not None:
            kept, reason = kept[:end], "stop"
        if reason is None and len(kept) >= self.budget:
            reason = "length"
        self.emitted += len(kept)
        if self.stop_strings:
            self._tail = (self._tail + kept)[-self._window:]
        return kept, reason

    def _stop_string_end(self, tokens: List[int]) -> Optional[int]:
        """Tokens to keep so the run ends with the first completed stop string."""
        if not self.stop_strings or not tokens:
            return None
        if not self._contains_stop(self._tail + tokens):
            return None
        for i in range(1, len(tokens) + 1):
            if self._contains_stop(self._tail + tokens[:i]):
                return i
        return None  # unreachable: the whole run contains a stop

    def _contains_stop(self, ids: List[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.stop_strings)


def text_before_stop(text: str, stop_strings: Sequence[str]) -> Optional[int]:
    """Index of the first stop string in ``text`` (None if there is none)."""
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that could begin a stop string.

    A streaming consumer holds these characters back until the next tokens show
    whether a stop string follows, so no part of a stop string is ever shown.
    """
    longest = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
