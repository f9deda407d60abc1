# Over 400 lines: the chat session with the reply decoder and stop-text holder that only it uses
"""A multi-turn chat over one target/drafter pair that keeps both caches between turns.

Both caches and the ids their rows hold are a :class:`~dflash_mlx.prompt_cache.pair.PairCache`
(common-prefix reuse, exact trimming, rollback on interrupts; the server uses the same).
A turn renders the whole conversation (chat template, or plain concatenation for models
without one) and lets it reuse the longest common prefix. So a new turn prefills its own
tokens only, and a history the template renders differently (e.g. thinking stripped from
earlier replies) is re-prefilled from the first differing token, never reused wrongly.
When a turn is interrupted, the partial reply is kept in the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence

import mlx.core as mx

from ..atomic import atomic_file
from ..errors import InputError
from ..decode.generate import check_block_size
from ..prompt import encode_messages
from ..prompt_cache.pair import PairCache, common_prefix, trim_cache  # noqa: F401 (trim_cache: re-exported)
from ..stats import GenerationStats, format_histogram
from ..decode.stopping import held_back, text_before_stop


class ContextFullError(InputError):
    """The conversation does not fit the model's context; reset to go on.

    Attributes:
        tokens: the rendered conversation's length, with the new turn.
        limit: the model's context length.
    """

    def __init__(self, tokens: int, limit: int):
        super().__init__(
            f"the conversation is {tokens} tokens with this turn and the model's context "
            f"is {limit} tokens: reset the conversation to go on"
        )
        self.tokens, self.limit = tokens, limit


@dataclass
class Piece:
    """A run of reply text with one look.

    Attributes:
        text: the text.
        drafted: the tokens were proposed by the drafter and accepted by the target
            (False: the target's own token, from prefill or the correction of a verify).
        thinking: inside ``<think> ... </think>`` (the markers included).
    """

    text: str
    drafted: bool = False
    thinking: bool = False


@dataclass
class ChatEvent:
    """One verify step of a reply, as :meth:`ChatSession.stream` yields it.

    Attributes:
        pieces: the step's text, split by look (may be empty while a multi-byte
            character is incomplete).
        tokens, accepted, finish_reason: as in :class:`dflash_mlx.StepResult`.
        stats: the live statistics of this turn.
    """

    pieces: List[Piece]
    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str]
    stats: GenerationStats


def plain_text(messages: Sequence[Dict[str, str]]) -> str:
    """The conversation for a model without a chat template: the turns' text
    concatenated. A reply continues its user turn directly; every other turn
    (system prompt, user) starts on a new line."""
    out = ""
    for m in messages:
        if m["role"] == "assistant" or not out:
            out += m["content"]
        else:
            out += "\n" + m["content"]
    return out


def _single_id(tokenizer: Any, name: str) -> Optional[int]:
    try:
        ids = getattr(tokenizer, name, None)
    except ValueError:
        return None
    return ids[0] if ids is not None and len(ids) == 1 else None


class ReplyDecoder:
    """Turns a reply's tokens into text pieces tagged drafted / thinking.

    The text of a run of tokens is ``decode(window + run) - decode(window)`` over the
    few tokens before it, so word-initial spaces (SentencePiece, byte-level BPE) land
    on the right token and the drafted/own split is exact. A run that ends inside a
    multi-byte character waits for the next tokens.

    Args:
        tokenizer: has ``decode``; ``think_start_tokens`` / ``think_end_tokens`` if
            the model thinks (single-token markers only).
        thinking: the prompt already opened a ``<think>`` block.
        context: prompt ids the reply continues, decoded as left context only (so a
            continuation keeps its leading space); empty: the reply stands alone.
        window: tokens of left context for decoding.
    """

    def __init__(self, tokenizer: Any, thinking: bool = False, context: Sequence[int] = (),
                 window: int = 8):
        self.tokenizer, self.window, self.thinking = tokenizer, window, thinking
        self.think_start = _single_id(tokenizer, "think_start_tokens")
        self.think_end = _single_id(tokenizer, "think_end_tokens")
        self.ids: List[int] = list(context[-window:]) if window else []
        self.done = len(self.ids)  # tokens whose text was emitted

    def add(self, tokens: Sequence[int], accepted: Optional[int], final: bool = False) -> List[Piece]:
        """Pieces for one step: the first ``accepted`` tokens were drafted."""
        pieces: List[Piece] = []
        run = None  # the look of the current run of tokens
        for i, tok in enumerate(tokens):
            look = (accepted is not None and i < accepted, self.thinking or tok == self.think_start)
            if tok == self.think_start:
                self.thinking = True
            elif tok == self.think_end:
                self.thinking = False
            if run is not None and look != run:
                self._emit(pieces, run, len(self.ids))
            self.ids.append(tok)
            run = look
        if run is not None or final:
            self._emit(pieces, run or (False, self.thinking), len(self.ids), force=final)
        return pieces

    def _emit(self, pieces: List[Piece], look, end: int, force: bool = False) -> None:
        start = max(0, self.done - self.window)
        before = self.tokenizer.decode(self.ids[start : self.done]) if self.done > start else ""
        for stop in range(end, max(self.done, end - 4), -1):  # back off an incomplete character
            after = self.tokenizer.decode(self.ids[start:stop])
            if force or not after.endswith("\ufffd"):
                break
        else:
            return
        text = after[common_prefix(before, after) :]
        self.done = stop
        if text:
            pieces.append(Piece(text, *look))


class StopText:
    """A reply's pieces up to its first stop string (the stop string is not shown).

    Text that could begin a stop string is held back until the next pieces settle
    it, as :func:`dflash_mlx.decode.generate.stream_generate` does for plain text.
    """

    def __init__(self, stop_strings: Sequence[str] = ()):
        self.stops = tuple(stop_strings)
        self.text = ""  # the reply's text so far
        self.shown = 0  # characters passed on
        self.waiting: List[Piece] = []

    def add(self, pieces: List[Piece], final: bool) -> List[Piece]:
        """The part of ``pieces`` (and of the held-back text) that may be shown now."""
        if not self.stops:
            return pieces
        self.waiting += pieces
        self.text += "".join(p.text for p in pieces)
        cut = text_before_stop(self.text, self.stops)
        if cut is not None:
            end = cut
        else:
            end = len(self.text) if final else len(self.text) - held_back(self.text, self.stops)
        return self._take(max(end - self.shown, 0))

    def _take(self, n: int) -> List[Piece]:
        out: List[Piece] = []
        while n > 0 and self.waiting:
            p = self.waiting[0]
            if len(p.text) <= n:
                out.append(self.waiting.pop(0))
            else:
                out.append(Piece(p.text[:n], p.drafted, p.thinking))
                self.waiting[0] = Piece(p.text[n:], p.drafted, p.thinking)
            n -= len(out[-1].text)
            self.shown += len(out[-1].text)
        return out


def starts_thinking(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an open ``<think>`` block."""
    start, end = _single_id(tokenizer, "think_start_tokens"), _single_id(tokenizer, "think_end_tokens")
    if start is None:
        return False
    last = {t: i for i, t in enumerate(ids) if t in (start, end)}
    return last.get(start, -1) > last.get(end, -1)


def context_length(model: Any) -> Optional[int]:
    """The context in tokens (``max_position_embeddings``) of a model or target
    adapter (whose ``args`` are the text model's), or None."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None) or None


class ChatSession:
    """A conversation with a target (and optionally its drafter), both caches kept.

    Args:
        target: the target adapter.
        tokenizer: mlx-lm ``TokenizerWrapper``.
        drafter: a bound drafter, or None for plain decoding.
        system_prompt: first message of every conversation (None: no system message).
        template_config: keyword arguments for ``apply_chat_template``
            (e.g. ``{"enable_thinking": False}``).
        use_template: render with the chat template when the tokenizer has one
            (default True); else the turns' text is concatenated (:func:`plain_text`).
        max_context: the model's context in tokens (default: the target's
            ``max_position_embeddings``; None: no limit).
        prefill_step_size: prefill chunk size (default 2048).
        store: a :class:`~dflash_mlx.prompt_cache.store.PrefixStore`: turns also resume from
            caches kept there (other sessions, earlier processes); None: this session's only.

    Attributes:
        messages: the conversation, ``{"role", "content"}`` dicts.
        pair_cache: both caches and the ids they hold (:class:`PairCache`).
        tokens: ids both caches hold, one row each.
        cache, draft_cache: the target's and the drafter's caches.
        totals: counters over every turn (histogram sized for the trained block).
    """

    def __init__(
        self,
        target: Any,
        tokenizer: Any,
        drafter: Optional[Any] = None,
        *,
        system_prompt: Optional[str] = None,
        template_config: Optional[dict] = None,
        use_template: bool = True,
        max_context: Optional[int] | str = "auto",
        prefill_step_size: int = 2048,
        store: Optional[Any] = None,
    ):
        self.pair_cache = PairCache(target, tokenizer, drafter, store=store)
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_config = dict(template_config or {})
        self.use_template = use_template and bool(getattr(tokenizer, "has_chat_template", False))
        self.max_context = context_length(target) if max_context == "auto" else max_context
        self.prefill_step_size = prefill_step_size
        self.messages: List[Dict[str, str]] = []
        self.reset()

    @classmethod
    def from_pair(cls, pair: Any, **kwargs) -> "ChatSession":
        """A session over a :class:`dflash_mlx.Pair`; kwargs as in the constructor."""
        return cls(pair.target, pair.tokenizer, pair.drafter, **kwargs)

    # -- conversation ------------------------------------------------------------

    @property
    def thinking(self) -> Optional[bool]:
        """``enable_thinking`` of the template config (None: the template's default)."""
        return self.template_config.get("enable_thinking")

    @thinking.setter
    def thinking(self, on: bool) -> None:
        self.template_config["enable_thinking"] = bool(on)

    def render(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        """Prompt ids for ``messages`` followed by the assistant's turn."""
        return encode_messages(self.tokenizer, messages, self.template_config, self.use_template, plain_text)

    def reset(self) -> None:
        """Clear the conversation (the system prompt stays), trim both caches to 0 and
        start the totals afresh."""
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.pair_cache.reset()
        self.totals = GenerationStats(block_size=self.drafter.block_size if self.drafter is not None else 1)
        self.turns = self.interrupted = 0

    def stream(
        self,
        text: str,
        *,
        sampler: Optional[Callable[[mx.array], mx.array]] = None,
        max_tokens: int = 256,
        block_size: Optional[int] = None,
        stop_strings: Sequence[str] = (),
    ) -> Generator[ChatEvent, None, None]:
        """Send one user turn and stream the reply.

        The turn is checked at once; the conversation and the caches change only
        while the returned generator runs.

        Args:
            text: the user's message.
            sampler: mlx-lm sampler (greedy by default).
            max_tokens: most tokens in the reply (also capped by the context left).
            block_size: B for this turn (default: the drafter's trained size).
            stop_strings: texts that end the reply (``finish_reason`` "stop"); the
                reply's text, shown and kept in ``messages``, stops before the first.

        Returns:
            A generator of :class:`ChatEvent`, one per verify step; the last has
            ``finish_reason`` set. If it is interrupted (``KeyboardInterrupt``) or
            closed early, the partial reply is kept in ``messages`` (the user turn is
            dropped if nothing was generated) and both caches are rolled back to the
            rows known to be complete.

        Raises:
            ContextFullError: the conversation with this turn does not fit the
                context; the session is unchanged.
            InputError: block size out of range, empty text or stop string.
        """
        if not text.strip():
            raise InputError("the message is empty")
        if any(not s for s in stop_strings):
            raise InputError("a stop string must not be empty")
        B = check_block_size(block_size, self.drafter)
        user = {"role": "user", "content": text}
        ids = self.render(self.messages + [user])
        if self.max_context is not None:
            if len(ids) >= self.max_context:
                raise ContextFullError(len(ids), self.max_context)
            max_tokens = min(max_tokens, self.max_context - len(ids))
        return self._turn(user, ids, sampler, max_tokens, B, tuple(stop_strings))

    def _turn(self, user, ids, sampler, max_tokens, block_size, stops) -> Generator[ChatEvent, None, None]:
        self.messages.append(user)
        context = () if self.use_template else ids  # plain: the reply continues the text
        decoder = ReplyDecoder(self.tokenizer, starts_thinking(self.tokenizer, ids), context)
        shown = StopText(stops)
        steps = self.pair_cache.stream(ids, sampler=sampler, max_tokens=max_tokens, block_size=block_size,
                                       prefill_step_size=self.prefill_step_size, stop_strings=stops)
        reply: List[int] = []
        stats, finished = None, False
        try:
            for r in steps:
                reply.extend(r.tokens)
                stats = r.stats
                final = r.finish_reason is not None
                yield ChatEvent(shown.add(decoder.add(r.tokens, r.accepted, final), final), r.tokens,
                                r.accepted, r.finish_reason, r.stats)
            finished = True
        finally:
            steps.close()  # settles both caches
            if reply or finished:
                content = self.reply_text(ids, reply)
                cut = text_before_stop(content, stops)
                self.messages.append({"role": "assistant", "content": content if cut is None else content[:cut]})
            else:
                self.messages.pop()
            self._count(stats, interrupted=not finished)

    def reply_text(self, ids: Sequence[int], reply: Sequence[int]) -> str:
        """A reply's text for the history: decoded on its own with a template, else as
        the continuation of the prompt (with its leading space, if any)."""
        if self.use_template:
            return self.tokenizer.decode(list(reply))
        head = list(ids[-8:])
        before, after = self.tokenizer.decode(head), self.tokenizer.decode(head + list(reply))
        return after[common_prefix(before, after) :]

    # -- caches ------------------------------------------------------------------

    # The pair and its caches live in the PairCache; these read and swap them there.
    target = property(lambda self: self.pair_cache.target,
                      lambda self, v: setattr(self.pair_cache, "target", v))
    drafter = property(lambda self: self.pair_cache.drafter,
                       lambda self, v: setattr(self.pair_cache, "drafter", v))
    tokens = property(lambda self: self.pair_cache.tokens, doc="Ids both caches hold, one row each.")
    cache = property(lambda self: self.pair_cache.cache, doc="The target's cache.")
    draft_cache = property(lambda self: self.pair_cache.draft_cache, doc="The drafter's cache (None: plain).")
    last_reused = property(lambda self: self.pair_cache.last_reused,
                           doc="Tokens of the last turn's prompt found in the caches.")

    def offsets(self) -> Dict[str, List[int]]:
        """Per-layer cache offsets: ``{"target": [...], "drafter": [...]}``."""
        return self.pair_cache.offsets()

    def is_consistent(self) -> bool:
        """Every layer of both caches holds exactly ``len(tokens)`` rows."""
        return self.pair_cache.is_consistent()

    @property
    def context_left(self) -> Optional[int]:
        """Tokens left in the context after the last reply (None: no limit)."""
        if self.max_context is None:
            return None
        return self.max_context - len(self.tokens) - 1

    # -- statistics and transcript ------------------------------------------------

    def _count(self, stats: Optional[GenerationStats], interrupted: bool) -> None:
        self.turns += 1
        self.interrupted += interrupted
        if stats is None:
            return
        self.totals.add(stats)

    def stats_lines(self) -> List[str]:
        """The session's totals: turns, prompt and generation, acceptance, histogram,
        memory, and the cache offsets (``Cache: N tokens (target N, drafter N)``)."""
        t = self.totals
        lines = [
            f"Turns: {self.turns} ({self.interrupted} interrupted)",
            t.prompt_line(),
            f"Generation: {t.generation_tokens} tokens, {t.generation_tps:.3f} tokens-per-sec",
        ]
        if self.drafter is not None:
            lines.append(f"Acceptance: {t.acceptance_line()}")
            if t.steps:
                lines.append("Histogram: " + format_histogram(t.histogram))
        lines.append(f"Peak memory: {t.peak_memory_gb:.3f} GB")
        offs = {k: sorted(set(v)) for k, v in self.offsets().items()}
        where = ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in offs.items())
        limit = f" of {self.max_context}" if self.max_context else ""
        lines.append(f"Cache: {len(self.tokens)} tokens{limit} ({where})"
                     + ("" if self.is_consistent() else " INCONSISTENT"))
        return lines

    def save(self, path: str | Path, meta: Optional[dict] = None) -> Path:
        """Write the transcript: JSON for ``*.json`` (messages and ``meta``), else Markdown.

        Raises:
            WriteError: the file cannot be written (any errno).
        """
        path = Path(path)
        if path.suffix.lower() == ".json":
            text = json.dumps({**(meta or {}), "messages": self.messages}, indent=2) + "\n"
        else:
            out = ["# Chat transcript\n"]
            out += [f"- {k}: {v}" for k, v in (meta or {}).items()]
            for m in self.messages:
                out.append(f"\n## {m['role'].capitalize()}\n\n{m['content']}")
            text = "\n".join(out) + "\n"
        with atomic_file(path) as tmp:
            tmp.write_text(text)
        return path
