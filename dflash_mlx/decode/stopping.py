"""Where a generation ends (a stop token, a stop string, the token budget) and the text
shown up to there. Stop strings match decoded text, as the OpenAI API defines them."""

from os.path import commonprefix
from typing import Any, Callable, List, Optional, Sequence, Tuple

Decode = Callable[[List[int]], str]
CHAR_BYTES = 4  # most bytes, so byte-fallback tokens, of one UTF-8 character


class StopCondition:
    """Cuts runs of committed tokens at a stop token (not emitted), a stop string (the token completing
    it is emitted; text consumers cut at :func:`text_before_stop`) or ``max_tokens`` (>= 1). ``decode``
    (ids -> text) is needed with ``stop_strings``; ``emitted`` counts tokens emitted so far.

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
        # left context that can hold the start of a stop string
        self._window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4
        self._tail: List[int] = []

    @property
    def budget(self) -> int:
        """Tokens that may still be emitted."""
        return self.max_tokens - self.emitted

    def cut(self, tokens: Sequence[int]) -> Tuple[List[int], Optional[str]]:
        """Keep ``tokens`` up to the first stop and count them: ``(kept, finish_reason)``, the reason
        ``"stop"`` (stop token or string), ``"length"`` (budget reached) or None."""
        kept, reason = list(tokens[: self.budget]), None
        if (end := next((i for i, tok in enumerate(kept) if tok in self.stop_ids), None)) is not None:
            kept, reason = kept[:end], "stop"
        if self.stop_strings and kept and self._contains_stop(self._tail + kept):  # end with the first one completed
            end = next(i for i in range(1, len(kept) + 1) if self._contains_stop(self._tail + kept[:i]))
            kept, reason = kept[:end], "stop"
        if reason is None and len(kept) >= self.budget:
            reason = "length"
        self.emitted += len(kept)
        if self.stop_strings:
            self._tail = (self._tail + kept)[-self._window:]
        return kept, reason

    def _contains_stop(self, ids: List[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.stop_strings)


def text_before_stop(text: str, stop_strings: Sequence[str]) -> Optional[int]:
    """Index of the first stop string in ``text`` (None if there is none)."""
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that could begin a stop string."""
    return max((n for s in stop_strings for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])),
               default=0)


class TextStream:
    """The text of one generation as its tokens arrive, cut before the first stop string (never shown).

    A run's text is ``tokenizer.decode(left + run)`` past ``decode(left)`` (the last run's decode: one a step) over
    ``window`` (>= 1) to ``2 * window`` tokens of left context (from ``context``, the prompt ids it continues), moved
    back to begin at a character: a byte-fallback decoder turns a whole run of byte tokens into U+FFFD when it begins
    inside one. A run ending inside a multi-byte character, or text that could begin a stop string, waits for the next
    tokens. ``text``: decoded so far (stop strings included); ``shown``: characters of it returned.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), context: Sequence[int] = (), window: int = 8):
        self.decode, self.window = tokenizer.decode, window
        self.stop_strings = tuple(stop_strings)
        self.ids: List[int] = list(context[-(window + CHAR_BYTES):])
        self.done = len(self.ids)  # ids whose text is in ``text``
        self.text, self.shown, self.stopped = "", 0, False
        self._last = (0, 0, "")  # (start, stop, decode(ids[start:stop])) of the last run

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take committed tokens; returns the new text safe to show (may be empty).
        ``final``: no tokens follow (incomplete characters are flushed)."""
        self.ids.extend(tokens)
        self._decode(final)
        if self.stopped:
            return ""
        cut = text_before_stop(self.text[self.shown:], self.stop_strings)
        if cut is not None:
            end, self.stopped = self.shown + cut, True
        else:
            end = len(self.text) - (0 if final else held_back(self.text, self.stop_strings))
        segment = self.text[self.shown:max(end, self.shown)]
        self.shown += len(segment)
        return segment

    def _decode(self, final: bool) -> None:
        start = max(0, self.done - self.window) // self.window * self.window  # moves by whole windows
        before = self._last[2] if self._last[:2] == (start, self.done) else self.decode(self.ids[start:self.done])
        lowest = max(0, start - CHAR_BYTES)
        while before.startswith("\ufffd") and start > lowest:  # the left context begins inside a character
            start -= 1
            before = self.decode(self.ids[start:self.done])
        for stop in range(len(self.ids), max(self.done, len(self.ids) - CHAR_BYTES), -1):  # back off a split one
            after = self.decode(self.ids[start:stop])
            if final or not after.endswith("\ufffd"):
                self.text += after[len(commonprefix([before, after])):]
                self.done, self._last = stop, (start, stop, after)
                return
