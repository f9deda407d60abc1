# Over 400 lines: the decode loop, read in one sitting: prefill, draft -> verify -> accept -> roll back, plain runs
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

from .acceptance import choose_rule
from ..errors import InputError
from ..kernels.block_attention import attention_path
from .tree import build_tree
from .width import AUTO, make_chooser, parse_block_size, parse_tree_budget
from ..protocol import Drafter
from ..stats import GenerationStats, weight_bytes
from .stopping import StopCondition, held_back, text_before_stop
from ..targets import TargetAdapter
from .verify import chain_step, host_logprobs, plain_step, synced, tree_step

Sampler = Callable[[mx.array], mx.array]
PLAIN_RUN = 16  # plain steps pipelined in a run where the chooser plans plain decoding
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
        error: set when this sequence failed (batched decoding: it left the batch,
            the others go on); None otherwise.
    """

    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None


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


def _sample(sampler: Sampler, logits: mx.array) -> mx.array:
    """Sample from [N, V] logits through log-probabilities, as mlx-lm does."""
    return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


class PrefillStopped(Exception):
    """``should_stop()`` turned true between two prefill chunks (a server's client went
    away); the caches hold the chunks done."""


def prefill(
    target: TargetAdapter,
    prompt: mx.array,
    cache: List[Any],
    capture: Optional[Sequence[int]],
    step_size: int = 2048,
    should_stop: Optional[Callable[[], bool]] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Chunked prefill with feature capture, chunked as mlx-lm's ``generate_step``.

    Returns:
        ``(hidden_last [1, 1, H], features [1, P, F] or None)``.

    Raises:
        PrefillStopped: ``should_stop()`` was true before a chunk.
    """
    features = []
    while prompt.size > 1:
        if should_stop is not None and should_stop():
            raise PrefillStopped()
        n = min(step_size, prompt.size - 1)
        _, f = target(prompt[None, :n], cache, capture)
        mx.eval([c.state for c in cache], f if f is not None else [])
        features.append(f)
        prompt = prompt[n:]
        mx.clear_cache()
    h, f = target(prompt[None], cache, capture)
    features.append(f)
    return h, (mx.concatenate(features, axis=1) if capture else None)


# Over 60 lines: the loop's entry: arguments documented, checked and wired in one place
def generate_step(
    prompt: mx.array,
    target: TargetAdapter,
    drafter: Optional[Drafter] = None,
    *,
    sampler: Optional[Sampler] = None,
    max_tokens: int = 256,
    block_size: Optional[int | str] = None,
    tree_budget: Optional[int | str] = None,
    stop_token_ids: Sequence[int] = (),
    stop: Optional[StopCondition] = None,
    prefill_step_size: int = 2048,
    should_stop: Optional[Callable[[], bool]] = None,
    prompt_cache: Optional[List[Any]] = None,
    draft_cache: Optional[List[Any]] = None,
    stats: Optional[GenerationStats] = None,
) -> Generator[StepResult, None, None]:
    """Decode from ``prompt``, with a drafter (DFlash) or without (plain).

    Args:
        prompt: [P] int32 prompt ids, P >= 1.
        target: the target adapter.
        drafter: a bound :class:`~dflash_mlx.protocol.Drafter`, or None for plain decoding.
        sampler: mlx-lm sampler over [N, V] log-probabilities, or a
            :class:`~dflash_mlx.sampling.Sampling` (also a sampler); greedy by default.
            The acceptance rule follows from it and the drafter
            (:func:`dflash_mlx.decode.acceptance.choose_rule`); each keeps the output exactly
            the target's.
        max_tokens: most tokens to emit.
        block_size: B, 2..drafter.block_size (default: the drafter's), or ``"auto"``:
            verify the width with the best measured rate, 1 (plain decoding) included
            (:mod:`dflash_mlx.decode.width`).
        tree_budget: DDTree (spec section 7): verify the N best draft prefixes as a
            tree (N nodes besides the root), or ``"auto"`` (a tree or chains, chosen
            by measured rate). Targets without tree verify (hybrid families)
            and drafters without log-probabilities keep chains; ``stats.verify``
            says so and why.
        stop_token_ids: ids that end generation; the block is cut there.
        stop: a :class:`~dflash_mlx.decode.stopping.StopCondition` (stop strings too);
            replaces ``max_tokens`` and ``stop_token_ids`` when given.
        should_stop: checked before each prefill chunk; when it returns True,
            :class:`PrefillStopped` is raised (a long prompt of a request whose client
            went away stops within one chunk, not after the whole prefill).
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
        InputError: empty prompt, max_tokens < 1, block size or tree budget out of range.
        RollbackError: ``prompt_cache`` cannot roll back exactly (raised before
            anything is generated).
        MismatchError: ``prompt_cache`` was built for another model, or the
            drafter's ``target_layer_ids`` are not layers of the target.
        PrefillStopped: see ``should_stop``.
    """
    sampler = sampler or greedy_sampler
    if prompt.size == 0:
        raise InputError("the prompt is empty: give some text with --prompt or on stdin")
    stop = stop or StopCondition(max_tokens, stop_token_ids)
    if stop.max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {stop.max_tokens}")
    B = check_block_size(block_size, drafter)
    tree_budget = parse_tree_budget(tree_budget)
    if tree_budget is not None and drafter is None:
        raise InputError("--tree-budget needs --draft-model (plain decoding has no drafts)")
    stats = stats if stats is not None else GenerationStats(block_size=B)
    chooser = None
    if drafter is not None:
        chooser = make_chooser(target, drafter, AUTO if block_size == AUTO else B, tree_budget, stats)
    max_verify = chooser.max_verify if chooser else B
    if prompt_cache is None:
        prompt_cache = target.make_cache(max_verify)
    else:
        target.check_cache(prompt_cache, max_verify)
    cache = prompt_cache
    committed = _cache_rows(cache) + prompt.size  # rows once every token is in the cache
    capture = drafter.target_layer_ids if drafter is not None else None

    with mx.stream(generation_stream):
        with stats.phase("prefill"):
            h, context = prefill(target, prompt, cache, capture, prefill_step_size, should_stop)
            t = _sample(sampler, target.lm_head(h[:, -1]))
            mx.eval(t)
        tokens, finish = stop.cut(t.tolist())
        if drafter is None:
            yield from _plain_steps(target, cache, t, tokens, finish, sampler, stop, stats, committed)
            return
        draft_cache = draft_cache if draft_cache is not None else drafter.make_cache()
        rule = choose_rule(drafter, sampler)
        stats.acceptance_rule = rule.name
        yield StepResult(tokens, None, finish)
        if finish is None:
            yield from _speculative_steps(target, cache, drafter, draft_cache, rule, chooser, t, context,
                                          stop, stats, committed)
        else:
            _finish(target, cache, committed + stop.emitted - 1, drafter, draft_cache, [context])


# Over 60 lines: one DFlash step read top to bottom: draft -> verify -> accept -> roll back
def _speculative_steps(target, cache, drafter, draft_cache, rule, chooser, t, context, stop, stats, base):
    """DFlash steps (spec section 5), each the chooser's plan: plain, chain or tree.

    ``t`` is the last committed token (not in the target cache); ``pending`` holds the
    context rows the drafter has not seen yet; ``history[i]`` sits at ``base + i``.
    Each step dispatches its device work first (the draft, or a plain forward), then
    hands the previous step's tokens to the consumer while the device runs, then
    reads the result: verify, accept, roll back (:mod:`dflash_mlx.decode.verify`). While
    plain decoding wins, runs of plain steps go as mlx-lm's (:func:`_plain_run`).
    """
    capture = drafter.target_layer_ids
    pending, history, finish = [context], [t.item()], None
    ready = None  # the last step's tokens, yielded once the next step is dispatched
    try:
        while finish is None:
            position = base + len(history) - 1  # of t
            plan = chooser.plan(1)
            if plan.width == 1:
                if ready is not None:
                    yield ready
                run = _plain_run(target, cache, capture, rule.choose, t, PLAIN_RUN, stop, stats, pending, history)
                ready, t, seconds, steps = yield from run
                finish = ready.finish_reason
                for _ in range(steps):
                    chooser.observe(plan, seconds, [0])
                continue
            tic = time.perf_counter()
            proposal = rule.propose(drafter, t, _rows(pending), draft_cache, plan.block)
            pending, draft_s = [], None
            if stats.time_draft():  # 1 step in 16: drafting on its own
                mx.eval(proposal.arrays())
                draft_s = time.perf_counter() - tic
            else:
                mx.async_eval(proposal.arrays())
            if ready is not None:  # the consumer's turn while the device works (not this step's time)
                paused = time.perf_counter()
                yield ready
                tic += time.perf_counter() - paused
            if plan.tree_budget is not None:
                tree = build_tree(history[-1], host_logprobs(proposal), plan.tree_budget)
                step = tree_step(target, cache, capture, rule.choose, position, proposal, tree)
            else:
                step = chain_step(target, cache, capture, rule, t, proposal, plan.width)
            seconds = time.perf_counter() - tic
            with stats.phase("host"), stats.host_work():
                pending.append(step.context)
                t = mx.array(step.tokens[-1:], dtype=mx.int32)
                history.extend(step.tokens)
                chooser.observe(plan, seconds, [step.accepted])
                mode, width = ("tree", plan.tree_budget) if plan.tree_budget is not None else ("chain", plan.width)
                stats.record_plan(mode, width, seconds, step.accepted, step.drafted, draft_s, step.wait_s)
                tokens, finish = stop.cut(step.tokens)
                ready = StepResult(tokens, step.accepted, finish)
            if stop.emitted % 256 < len(tokens):
                mx.clear_cache()
        _finish(target, cache, base + stop.emitted - 1, drafter, draft_cache, pending)
        yield ready
    except GeneratorExit:  # closed mid-generation: both caches hold the tokens yielded so far but the last
        if finish is None:
            _finish(target, cache, base + len(history) - 1, drafter, draft_cache, pending)
        raise


def _plain_run(target, cache, capture, choose, t, steps, stop, stats, pending, history):
    """Up to ``steps`` plain steps pipelined as mlx-lm's (step n+1 is queued before n is
    read), each capturing its context features for the drafter; yields every step's
    :class:`StepResult` but the last, which it returns.

    Returns:
        ``(last StepResult, last committed token [1] int32, seconds per step, steps run)``.
    """
    tic = time.perf_counter()
    paused = wait = 0.0
    y, features = plain_step(target, cache, capture, choose, t)
    result = None
    for i in range(steps):
        queued = plain_step(target, cache, capture, choose, y) if i + 1 < steps and stop.budget > 1 else None
        if queued is not None:
            mx.async_eval(*queued)
        if result is not None:  # the consumer's turn while the device works
            pause = time.perf_counter()
            yield result
            paused += time.perf_counter() - pause
        wait += synced(y, features)
        tokens = y.tolist()
        pending.append(features)
        history.extend(tokens)
        kept, finish = stop.cut(tokens)
        result = StepResult(kept, None, finish)
        if finish is not None or queued is None:
            break
        y, features = queued
    seconds = time.perf_counter() - tic - paused
    for _ in range(i + 1):
        stats.record_plan("plain", 1, seconds / (i + 1), 0, 0, wait_s=wait / (i + 1))
    if stop.emitted % 256 < i + 1:
        mx.clear_cache()
    return result, y, seconds / (i + 1), i + 1


def _rows(pending: List[mx.array]) -> mx.array:
    """The pending context rows as one [1, S, F] array."""
    return pending[0] if len(pending) == 1 else mx.concatenate(pending, axis=1)


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
        stats.record_plain()
        if finish is not None:
            _finish(target, cache, committed + stop.emitted - 1)
        yield StepResult(tokens, None, finish)
        if stop.emitted % 256 == 0:
            mx.clear_cache()


def _cache_rows(cache: List[Any]) -> int:
    return getattr(cache[0], "offset", 0) if cache else 0


def _finish(target: TargetAdapter, cache: List[Any], rows: int, drafter: Optional[Drafter] = None,
            draft_cache: Optional[List[Any]] = None, pending: Sequence[mx.array] = ()) -> None:
    """At the end of a generation: trim the target cache to ``rows`` tokens (rows of
    forwards past the committed ones), then give the drafter the context rows the
    target cache holds but it does not (``pending`` rows start at the drafter's
    offset), so both caches cover the same tokens."""
    target.rollback(cache, _cache_rows(cache) - rows)
    if drafter is not None:
        missing = _cache_rows(cache) - _cache_rows(draft_cache)
        if missing > 0:
            drafter.ingest(_rows(list(pending))[:, :missing], draft_cache)


def check_block_size(block_size: Optional[int | str], drafter: Optional[Drafter]) -> int:
    """Resolve B, the block the drafter drafts: 1 without a drafter, else 2..trained
    block size (the trained size for None and ``"auto"``).

    Raises:
        InputError: naming ``--block-size`` and the allowed range.
    """
    if drafter is None:
        return 1
    trained = drafter.block_size
    block_size = parse_block_size(block_size)
    B = trained if block_size in (None, AUTO) else block_size
    if not 2 <= B <= trained:
        raise InputError(
            f"--block-size {B} is out of range: this drafter supports 2..{trained} "
            "(its trained block size)"
        )
    return B


# Over 60 lines: mostly its docstring: the text-level wrapper of generate_step
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
        target_bytes=weight_bytes(target.model),
        drafter_bytes=weight_bytes(drafter) if isinstance(drafter, nn.Module) else 0,
        speculative=drafter is not None,
        reason=None if drafter is not None else NO_DRAFTER,
        drafter_format=getattr(drafter, "drafter_format", None),
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
