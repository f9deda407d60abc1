"""One request's text as its tokens arrive, for the batching engine: detokenized
incrementally, with text that could begin a stop string held back until the next
tokens settle it, and cut before the first stop string at the end (the same rules
as :func:`dflash_mlx.decode.generate.stream_generate`, which the one-at-a-time
engine uses)."""

from __future__ import annotations

from typing import Any, Sequence

from ..decode.stopping import held_back, text_before_stop


class TextStream:
    """Incremental text of one generation.

    Args:
        tokenizer: mlx-lm ``TokenizerWrapper`` (each stream gets its own detokenizer:
            its ``detokenizer`` property returns a fresh copy).
        stop_strings: texts that end the generation (never shown).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop_strings = tuple(stop_strings)
        self.text, self.shown = "", 0

    def add(self, tokens: Sequence[int], final: bool) -> str:
        """Take one step's committed tokens; returns the new text safe to show (may be
        empty). ``final``: the generation ended with this step."""
        for tok in tokens:
            self.detokenizer.add_token(tok)
        if final:
            self.detokenizer.finalize()
        self.text += self.detokenizer.last_segment
        end = len(self.text) - held_back(self.text, self.stop_strings)
        if final:
            cut = text_before_stop(self.text[self.shown:], self.stop_strings)
            end = len(self.text) if cut is None else self.shown + cut
        segment = self.text[self.shown:max(end, self.shown)]
        self.shown = max(end, self.shown)
        return segment
