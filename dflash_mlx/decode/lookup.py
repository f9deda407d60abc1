"""Prompt lookup: drafts copied from the context. Where the sequence's last ``n`` tokens (``n`` from
``MAX_NGRAM`` down to ``MIN_NGRAM``) occurred before, in the prompt or the output, the tokens that followed
that latest occurrence are proposed (up to ``MAX_COPY``). A copy is a point mass: the acceptance rules verify
it exactly like any draft (one-hot q). A copy that gains nothing pauses lookup for a growing number of
steps (2, 4, ... 64), one that does resets the pause."""

from typing import Dict, List, Sequence, Tuple

from ..protocol import MAX_COPY

MIN_NGRAM, MAX_NGRAM = 3, 6
MAX_PAUSE = 64


class PromptLookup:
    """The token history of one sequence and an index of its n-grams' latest earlier occurrences."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens: List[int] = []
        self.last: Dict[Tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ended
        self.pause, self.paused = 0, 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens (the n-grams ending at the newest token are indexed at the next call,
        so that a lookup never finds the tail itself)."""
        for t in tokens:
            end = len(self.tokens)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.last[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(t))
        self.paused = max(0, self.paused - 1)

    def propose(self, limit: int = MAX_COPY) -> List[int]:
        """At most ``limit`` (and ``MAX_COPY``) tokens that followed the longest earlier match of the tail;
        [] where there is none or lookup is paused."""
        limit = min(limit, MAX_COPY)
        if self.paused or limit < 1:
            return []
        for n in range(min(MAX_NGRAM, len(self.tokens)), MIN_NGRAM - 1, -1):
            end = self.last.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end:end + limit]
        return []

    def observe(self, accepted: int) -> None:
        """A copy's verify kept ``accepted`` drafts: none pauses lookup (longer each time), any resets."""
        self.pause = 0 if accepted else min(MAX_PAUSE, max(2, 2 * self.pause))
        self.paused = self.pause
