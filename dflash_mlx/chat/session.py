"""A multi-turn chat over one pair, both caches kept between turns (a :class:`PairCache`)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import InputError
from ..decode.generate import check_block_size, stream_generate
from ..decode.stopping import TextStream, text_before_stop
from ..prompt import context_length, encode_messages, plain_text
from ..prompt_cache.pair import PairCache
from ..stats import GenerationStats, format_histogram
from .session_file import write_transcript


class ContextFullError(InputError):
    """The conversation (``tokens`` with the new turn) does not fit the model's context (``limit``)."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the conversation is {tokens} tokens with this turn and the model's context "
                         f"is {limit} tokens: reset the conversation to go on")
        self.tokens, self.limit = tokens, limit


@dataclass
class Piece:
    """A run of reply text with one look: ``drafted`` (accepted drafts), ``thinking`` (inside ``<think>``)."""

    text: str
    drafted: bool = False
    thinking: bool = False


@dataclass
class ChatEvent:
    """One verify step of a reply: its text in ``pieces`` by look; the rest as in :class:`dflash_mlx.StepResult`."""

    pieces: List[Piece]
    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str]
    stats: GenerationStats


def _single_id(tokenizer: Any, name: str) -> Optional[int]:
    try:
        ids = getattr(tokenizer, name, None)
    except ValueError:
        return None
    return ids[0] if ids is not None and len(ids) == 1 else None


def starts_thinking(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an open ``<think>`` block."""
    start, end = _single_id(tokenizer, "think_start_tokens"), _single_id(tokenizer, "think_end_tokens")
    last = {t: i for i, t in enumerate(ids) if t in (start, end)}
    return start is not None and last.get(start, -1) > last.get(end, -1)


class ReplyDecoder:
    """A reply's text in pieces tagged drafted / thinking, cut before the first stop string (never shown).
    ``thinking``: the prompt opened a ``<think>`` block; ``context``: prompt ids the reply continues."""

    def __init__(self, tokenizer: Any, thinking: bool = False, context: Sequence[int] = (),
                 stop_strings: Sequence[str] = ()):
        self.stream = TextStream(tokenizer, stop_strings, context)
        self.think_start = _single_id(tokenizer, "think_start_tokens")
        self.think_end = _single_id(tokenizer, "think_end_tokens")
        self.thinking = thinking
        self.looks: List[Tuple[int, Tuple[bool, bool]]] = []  # (end in stream.text, look) of unshown text
        self.base = 0  # where the first of ``looks`` starts

    def add(self, tokens: Sequence[int], accepted: Optional[int], final: bool = False) -> List[Piece]:
        """Pieces for one step (the first ``accepted`` tokens were drafted) safe to show."""
        start, look = self.stream.shown, (False, self.thinking)
        for run, look in self._runs(tokens, accepted):
            self.stream.add(run)
            self.looks.append((len(self.stream.text), look))
        if final:
            self.stream.add([], final=True)
            self.looks.append((len(self.stream.text), look))
        return self._pieces(start, self.stream.shown)

    def text(self) -> str:
        """The whole reply before its first stop string (flushes a split character)."""
        self.stream.add([], final=True)
        return self.stream.text[:text_before_stop(self.stream.text, self.stream.stop_strings)]

    def _runs(self, tokens: Sequence[int], accepted: Optional[int]) -> List[Tuple[List[int], Tuple[bool, bool]]]:
        runs: List[Tuple[List[int], Tuple[bool, bool]]] = []
        for i, tok in enumerate(tokens):
            look = (accepted is not None and i < accepted, self.thinking or tok == self.think_start)
            if tok in (self.think_start, self.think_end):
                self.thinking = tok == self.think_start
            if runs and runs[-1][1] == look:
                runs[-1][0].append(tok)
            else:
                runs.append(([tok], look))
        return runs

    def _pieces(self, start: int, end: int) -> List[Piece]:
        out: List[Piece] = []
        lo = self.base
        for hi, look in self.looks:
            a, b = max(lo, start), min(hi, end)
            if a < b and out and (out[-1].drafted, out[-1].thinking) == look:
                out[-1].text += self.stream.text[a:b]
            elif a < b:
                out.append(Piece(self.stream.text[a:b], *look))
            lo = hi
        while self.looks and self.looks[0][0] <= end:
            self.base = self.looks.pop(0)[0]
        return out


class ChatSession:
    """A conversation with a target (and optionally its drafter), both caches kept.

    Args:
        template_config: keyword arguments for ``apply_chat_template``.
        use_template: render with the chat template when there is one (else :func:`dflash_mlx.prompt.plain_text`).
        max_context: the context in tokens ("auto": the target's; None: no limit).
        store: a :class:`~dflash_mlx.prompt_cache.store.PrefixStore` to resume from too.

    Attributes:
        messages: ``{"role", "content"}`` dicts; pair_cache: the caches; totals, turns, interrupted: counts.
    """

    def __init__(self, target: Any, tokenizer: Any, drafter: Optional[Any] = None, *,
                 system_prompt: Optional[str] = None, template_config: Optional[dict] = None, use_template: bool = True,
                 max_context: Optional[int] | str = "auto", prefill_step_size: int = 2048, store: Optional[Any] = None):
        self.pair_cache = PairCache(target, tokenizer, drafter, store=store, generate=stream_generate)
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_config = dict(template_config or {})
        self.use_template = use_template and bool(getattr(tokenizer, "has_chat_template", False))
        self.max_context = context_length(target) if max_context == "auto" else max_context
        self.prefill_step_size = prefill_step_size
        self.reset()

    @classmethod
    def from_pair(cls, pair: Any, **kwargs) -> "ChatSession":
        """A session over a :class:`dflash_mlx.Pair`; kwargs as in the constructor."""
        return cls(pair.target, pair.tokenizer, pair.drafter, **kwargs)

    @property
    def thinking(self) -> Optional[bool]:
        """``enable_thinking`` of the template config (None: the template's default)."""
        return self.template_config.get("enable_thinking")

    @thinking.setter
    def thinking(self, on: bool) -> None:
        self.template_config["enable_thinking"] = bool(on)

    @property
    def tokens(self) -> List[int]:
        """Ids both caches hold."""
        return self.pair_cache.tokens

    @property
    def context_left(self) -> Optional[int]:
        """Tokens left in the context after the last reply (None: no limit)."""
        return None if self.max_context is None else self.max_context - len(self.tokens) - 1

    def render(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        """Prompt ids for ``messages`` followed by the assistant's turn."""
        return encode_messages(self.tokenizer, messages, self.template_config, self.use_template, plain_text)

    def reset(self) -> None:
        """Clear the conversation (the system prompt stays), both caches and the totals."""
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.pair_cache.reset()
        drafter = self.pair_cache.drafter
        self.totals = GenerationStats(block_size=drafter.block_size if drafter is not None else 1)
        self.turns = self.interrupted = 0

    def stream(self, text: str, *, sampler: Optional[Callable[[mx.array], mx.array]] = None,
               max_tokens: int = 256, block_size: Optional[int | str] = None, stop_strings: Sequence[str] = (),
               prompt_lookup: bool = False) -> Generator[ChatEvent, None, None]:
        """Send one user turn; returns a generator of :class:`ChatEvent`, one per verify step (the session
        changes only while it runs; closed early, it keeps the partial reply). ``max_tokens`` is also capped by
        the context left; ``stop_strings`` end the reply (``finish_reason`` "stop"), not shown nor kept;
        ``block_size`` as :func:`~dflash_mlx.decode.generate.generate_step` takes it (``auto`` included).

        Raises:
            ContextFullError: the conversation with this turn does not fit.
            InputError: block size out of range, empty text or stop string.
        """
        if not text.strip():
            raise InputError("the message is empty")
        if any(not s for s in stop_strings):
            raise InputError("a stop string must not be empty")
        check_block_size(block_size, self.pair_cache.drafter)
        user = {"role": "user", "content": text}
        ids = self.render(self.messages + [user])
        if self.max_context is not None:
            if len(ids) >= self.max_context:
                raise ContextFullError(len(ids), self.max_context)
            max_tokens = min(max_tokens, self.max_context - len(ids))
        return self._turn(user, ids, sampler, max_tokens, tuple(stop_strings), block_size=block_size,
                          prompt_lookup=prompt_lookup)

    def _turn(self, user, ids, sampler, max_tokens, stops, **how) -> Generator[ChatEvent, None, None]:
        self.messages.append(user)
        context = () if self.use_template else ids  # plain: the reply continues the text
        decoder = ReplyDecoder(self.tokenizer, starts_thinking(self.tokenizer, ids), context, stops)
        steps = self.pair_cache.stream(ids, sampler=sampler, max_tokens=max_tokens, **how,
                                       prefill_step_size=self.prefill_step_size, stop_strings=stops)
        stats, generated, finished = None, False, False
        try:
            for r in steps:
                stats, generated = r.stats, generated or bool(r.tokens)
                pieces = decoder.add(r.tokens, r.accepted, r.finish_reason is not None)
                yield ChatEvent(pieces, r.tokens, r.accepted, r.finish_reason, r.stats)
            finished = True
        finally:
            steps.close()  # settles both caches
            if generated or finished:
                self.messages.append({"role": "assistant", "content": decoder.text()})
            else:
                self.messages.pop()
            self.turns += 1
            self.interrupted += not finished
            if stats is not None:
                self.totals.add(stats)

    def stats_lines(self) -> List[str]:
        """The session's totals, ending ``Cache: N tokens (target N, drafter N)``."""
        t = self.totals
        lines = [f"Turns: {self.turns} ({self.interrupted} interrupted)", t.prompt_line(),
                 f"Generation: {t.generation_tokens} tokens, {t.generation_tps:.3f} tokens-per-sec"]
        if self.pair_cache.drafter is not None:
            lines.append(f"Acceptance: {t.acceptance_line() if self.turns else 'no turns yet'}")
            if t.steps:
                lines.append("Histogram: " + format_histogram(t.histogram))
        lines.append(f"Peak memory: {t.peak_memory_gb:.3f} GB")
        offs = {k: sorted(set(v)) for k, v in self.pair_cache.offsets().items()}
        where = ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in offs.items())
        limit = f" of {self.max_context}" if self.max_context else ""
        lines.append(f"Cache: {len(self.tokens)} tokens{limit} ({where})"
                     + ("" if self.pair_cache.is_consistent() else " INCONSISTENT"))
        return lines

    def save(self, path: str | Path, meta: Optional[dict] = None) -> Path:
        """Write the transcript (see :func:`~dflash_mlx.chat.session_file.write_transcript`)."""
        return write_transcript(Path(path), self.messages, meta)
