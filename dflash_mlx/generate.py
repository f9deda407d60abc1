"""The DFlash decode loop (DFLASH_SPEC.md section 5) and plain decoding, one engine.

``generate_step`` yields one :class:`StepResult` per target forward: prefill gives
the first token, then each verify commits ``accepted + 1`` tokens. ``stream_generate``
adds detokenized text and statistics; ``generate``, ``chat`` and ``bench`` use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import InputError
from .kernels.block_attention import attention_path
from .protocol import Drafter
from .stats import GenerationStats, weight_bytes
from .stopping import StopCondition, held_back, text_before_stop
from .targets import TargetAdapter

Sampler = Callable[[mx.array], mx.array]
NO_DRAFTER = "no drafter was given (--draft-model)"


@dataclass
class StepResult:
    """What one target forward committed.

    Attributes:
        tokens: newly committed token ids (a stop token is not included; the
            tokens of a stop string are).
        accepted: drafts accepted by this verify (0..B-1); None for the first
            token (from prefill) and in plain decoding.
        finish_reason: "stop" (stop token or stop string), "length" (max tokens)
            or None.
    """

    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str] = None


@dataclass
class GenerationResponse:
    """One streamed chunk of :func:`stream_generate`.

    Attributes:
        text: detokenized text of this step's tokens (may be empty).
        tokens, accepted, finish_reason: as in :class:`StepResult`.
        stats: the live statistics of this generation.
    """

    text: str
    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str]
    stats: GenerationStats


def _sample(sampler: Sampler, logits: mx.array, exact: bool = True) -> mx.array:
    """Sample from [N, V] logits through log-probabilities, as mlx-lm does.

    With ``exact=False`` greedy skips the normalisation (same argmax up to float
    ties; used in verify, whose 16-row matmuls differ in the last bits anyway).
    """
    if not exact and sampler is greedy_sampler:
        return mx.argmax(logits, axis=-1)
    return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def count_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Leading drafts that match the target: number of i with d_i == y_{i-1}."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def prefill(
    target: TargetAdapter,
    prompt: mx.array,
    cache: List[Any],
    capture: Optional[Sequence[int]],
    step_size: int = 2048,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Chunked prefill with feature capture, chunked as mlx-lm's ``generate_step``.

    Returns:
        ``(hidden_last [1, 1, H], features [1, P, F] or None)``.
    """
    features = []
    while prompt.size > 1:
        n = min(step_size, prompt.size - 1)
        _, f = target(prompt[None, :n], cache, capture)
        mx.eval([c.state for c in cache], f if f is not None else [])
        features.append(f)
        prompt = prompt[n:]
        mx.clear_cache()
    h, f = target(prompt[None], cache, capture)
    features.append(f)
    return h, (mx.concatenate(features, axis=1) if capture else None)


def generate_step(
    prompt: mx.array,
    target: TargetAdapter,
    drafter: Optional[Drafter] = None,
    *,
    sampler: Optional[Sampler] = None,
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    stop_token_ids: Sequence[int] = (),
    stop: Optional[StopCondition] = None,
    prefill_step_size: int = 2048,
    prompt_cache: Optional[List[Any]] = None,
    draft_cache: Optional[List[Any]] = None,
    stats: Optional[GenerationStats] = None,
) -> Generator[StepResult, None, None]:
    """Decode from ``prompt``, with a drafter (DFlash) or without (plain).

    Args:
        prompt: [P] int32 prompt ids, P >= 1.
        target: the target adapter.
        drafter: a bound :class:`~dflash_mlx.protocol.Drafter`, or None for plain decoding.
        sampler: mlx-lm sampler over [N, V] log-probabilities; greedy by default.
            At T > 0 the sample-and-match rule keeps the output exactly the target's.
        max_tokens: most tokens to emit.
        block_size: B, 2..drafter.block_size (default: the drafter's).
        stop_token_ids: ids that end generation; the block is cut there.
        stop: a :class:`~dflash_mlx.stopping.StopCondition` (stop strings too);
            replaces ``max_tokens`` and ``stop_token_ids`` when given.
        prompt_cache: the target's cache, updated in place (default: a fresh
            ``target.make_cache(B)``; a given one must roll back exactly and belong
            to this target, see :meth:`TargetAdapter.check_cache`). After every step
            it holds every committed token but the last one.
        draft_cache: the drafter's context-only cache, updated in place. Once a
            generation finishes it covers the same tokens as ``prompt_cache``, so a
            next turn can pass both, with a prompt that starts at the last
            committed token.
        stats: filled in place (phase times, acceptance).

    Raises:
        InputError: empty prompt, max_tokens < 1, block size out of range.
        RollbackError: ``prompt_cache`` cannot roll back exactly (raised before
            anything is generated).
        MismatchError: ``prompt_cache`` was built for another model, or the
            drafter's ``target_layer_ids`` are not layers of the target.
    """
    sampler = sampler or greedy_sampler
    if prompt.size == 0:
        raise InputError("the prompt is empty: give some text with --prompt or on stdin")
    stop = stop or StopCondition(max_tokens, stop_token_ids)
    if stop.max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {stop.max_tokens}")
    B = check_block_size(block_size, drafter)
    stats = stats if stats is not None else GenerationStats(block_size=B)
    if prompt_cache is None:
        prompt_cache = target.make_cache(B)
    else:
        target.check_cache(prompt_cache, B)
    cache = prompt_cache
    committed = _cache_rows(cache) + prompt.size  # rows once every token is in the cache
    capture = drafter.target_layer_ids if drafter is not None else None

    with mx.stream(generation_stream):
        with stats.phase("prefill"):
            h, context = prefill(target, prompt, cache, capture, prefill_step_size)
            t = _sample(sampler, target.lm_head(h[:, -1]))
            mx.eval(t)
        tokens, finish = stop.cut(t.tolist())
        if drafter is None:
            yield from _plain_steps(target, cache, t, tokens, finish, sampler, stop, stats, committed)
            return
        draft_cache = draft_cache if draft_cache is not None else drafter.make_cache()
        if finish is None:
            drafts = drafter.draft(t, context, draft_cache, B)
            mx.async_eval(drafts)
        else:
            _finish(target, cache, committed + stop.emitted - 1, drafter, draft_cache, context)
        yield StepResult(tokens, None, finish)
        while finish is None:
            with stats.phase("draft"):
                mx.eval(drafts)
            with stats.phase("verify"):
                h, features = target(mx.concatenate([t, drafts])[None], cache, capture)
                y = _sample(sampler, target.lm_head(h)[0], exact=False)
                mx.eval(y, features)
            with stats.phase("host"):
                y_list = y.tolist()
                a = count_accepted(drafts.tolist(), y_list)
                stats.record_step(a, B - 1)
                target.rollback(cache, B - 1 - a)
                tokens, finish = stop.cut(y_list[: a + 1])
                if finish is not None:
                    _finish(target, cache, committed + stop.emitted - 1, drafter, draft_cache, features)
            if finish is None:
                # Queue the next draft before yielding. On the CPU backend async_eval
                # runs most of it right here, so it is booked as drafting.
                with stats.phase("draft"):
                    t = y[a : a + 1]
                    drafts = drafter.draft(t, features[:, : a + 1], draft_cache, B)
                    mx.async_eval(drafts)
            yield StepResult(tokens, a, finish)
            if stop.emitted % 256 < len(tokens):
                mx.clear_cache()


def _plain_steps(target, cache, y, tokens, finish, sampler, stop, stats, committed):
    """Plain decoding, pipelined like mlx-lm: step n+1 is queued before n is read."""

    def step(y: mx.array) -> mx.array:
        h, _ = target(y[None], cache)
        return _sample(sampler, target.lm_head(h[:, -1]))

    if finish is None:
        next_y = step(y)
        mx.async_eval(next_y)
    else:
        _finish(target, cache, committed + stop.emitted - 1)
    yield StepResult(tokens, None, finish)
    while finish is None:
        with stats.phase("verify"):
            y = next_y
            if stop.budget > 1:
                next_y = step(y)
                mx.async_eval(next_y)
            tokens, finish = stop.cut(y.tolist())
        stats.record_step(0, drafted=0)
        if finish is not None:
            _finish(target, cache, committed + stop.emitted - 1)
        yield StepResult(tokens, None, finish)
        if stop.emitted % 256 == 0:
            mx.clear_cache()


def _cache_rows(cache: List[Any]) -> int:
    return getattr(cache[0], "offset", 0) if cache else 0


def _finish(target: TargetAdapter, cache: List[Any], rows: int, drafter: Optional[Drafter] = None,
            draft_cache: Optional[List[Any]] = None, features: Optional[mx.array] = None) -> None:
    """At the end of a generation: trim the target cache to ``rows`` tokens (rows of
    the last forward past the committed ones), then give the drafter the context rows
    the target cache holds but it does not (``features`` start at the drafter's
    offset), so both caches cover the same tokens."""
    target.rollback(cache, _cache_rows(cache) - rows)
    if drafter is not None:
        missing = _cache_rows(cache) - _cache_rows(draft_cache)
        drafter.ingest(features[:, :missing], draft_cache)


def check_block_size(block_size: Optional[int], drafter: Optional[Drafter]) -> int:
    """Resolve B: 1 without a drafter, else 2..trained block size.

    Raises:
        InputError: naming ``--block-size`` and the allowed range.
    """
    if drafter is None:
        return 1
    trained = drafter.block_size
    B = trained if block_size is None else int(block_size)
    if not 2 <= B <= trained:
        raise InputError(
            f"--block-size {B} is out of range: this drafter supports 2..{trained} "
            "(its trained block size)"
        )
    return B


def stream_generate(
    target: TargetAdapter,
    tokenizer: TokenizerWrapper,
    prompt: mx.array | List[int],
    drafter: Optional[Drafter] = None,
    *,
    max_tokens: int = 256,
    stop_strings: Sequence[str] = (),
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Stream text segments as blocks are accepted.

    Args:
        target, drafter: as in :func:`generate_step`.
        tokenizer: mlx-lm ``TokenizerWrapper`` (its streaming detokenizer and
            ``eos_token_ids`` are used).
        prompt: prompt token ids.
        max_tokens: most tokens to emit.
        stop_strings: texts that end generation. The text stops before the first
            match (the stop string is not shown; text that could begin one is held
            back until the next tokens settle it); the tokens up to the one that
            completes it are committed.
        kwargs: passed to :func:`generate_step` (sampler, block_size, caches, ...).

    Yields:
        :class:`GenerationResponse`; the last one has ``finish_reason`` set and
        carries the final statistics.
    """
    prompt = prompt if isinstance(prompt, mx.array) else mx.array(prompt, dtype=mx.int32)
    stop_ids = kwargs.pop("stop_token_ids", tuple(tokenizer.eos_token_ids))
    kwargs["stop"] = StopCondition(max_tokens, stop_ids, stop_strings, tokenizer.decode)
    stats = GenerationStats(
        block_size=check_block_size(kwargs.get("block_size"), drafter),
        prompt_tokens=prompt.size,
        model_bytes=weight_bytes(target.model, drafter if isinstance(drafter, nn.Module) else None),
        speculative=drafter is not None,
        reason=None if drafter is not None else NO_DRAFTER,
    )
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    text, shown = "", 0  # text of this generation; characters yielded so far
    tic = time.perf_counter()
    first = True
    with wired_limit(target.model, [generation_stream]):
        for step in generate_step(prompt, target, drafter, stats=stats, **kwargs):
            now = time.perf_counter()
            if first:
                stats.prompt_s, tic, first = now - tic, now, False
            else:
                stats.generation_s = now - tic
            stats.generation_tokens += len(step.tokens)
            for tok in step.tokens:
                detokenizer.add_token(tok)
            if step.finish_reason is not None:
                detokenizer.finalize()
            text += detokenizer.last_segment
            end = len(text) - held_back(text, stop_strings)
            if step.finish_reason is not None:
                cut = text_before_stop(text[shown:], stop_strings)
                end = len(text) if cut is None else shown + cut
            segment, shown = text[shown:max(end, shown)], max(end, shown)
            stats.update_memory()
            if drafter is not None:
                stats.block_attention = attention_path()
            yield GenerationResponse(segment, step.tokens, step.accepted, step.finish_reason, stats)


def generate(
    target: TargetAdapter,
    tokenizer: TokenizerWrapper,
    prompt: mx.array | List[int],
    drafter: Optional[Drafter] = None,
    **kwargs,
) -> Tuple[str, GenerationStats]:
    """Generate a whole response; returns ``(text, stats)``."""
    text, stats = "", None
    for response in stream_generate(target, tokenizer, prompt, drafter, **kwargs):
        text += response.text
        stats = response.stats
    return text, stats
