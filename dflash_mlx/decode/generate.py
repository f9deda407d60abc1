"""Generation from one prompt (spec section 5): ``generate_step`` runs the step of
:mod:`dflash_mlx.decode.batch` for one sequence; ``stream_generate`` adds text and statistics."""

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .batch import BatchDecoder
from .batch_join import OwnCaches, StepResult
from ..errors import InputError
from .width import AUTO, make_chooser, parse_block_size, parse_tree_budget
from ..protocol import Drafter
from ..sampling import Sampler
from ..stats import GenerationStats
from .stopping import StopCondition, TextStream
from ..targets import TargetAdapter


@dataclass
class GenerationResponse:
    """One streamed chunk: this step's ``text`` (may be empty), ``tokens``, ``accepted`` and
    ``finish_reason`` as in :class:`StepResult`, and the generation's live ``stats``."""

    text: str
    tokens: List[int]
    accepted: Optional[int]
    finish_reason: Optional[str]
    stats: GenerationStats


def generate_step(prompt: mx.array, target: TargetAdapter, drafter: Optional[Drafter] = None, *,
                  sampler: Optional[Sampler] = None, max_tokens: int = 256, block_size: Optional[int | str] = None,
                  tree_budget: Optional[int | str] = None, stop_token_ids: Sequence[int] = (),
                  stop: Optional[StopCondition] = None, prefill_step_size: int = 2048,
                  should_stop: Optional[Callable[[], bool]] = None, prompt_cache: Optional[List[Any]] = None,
                  draft_cache: Optional[List[Any]] = None, stats: Optional[GenerationStats] = None,
                  prompt_lookup: bool = False, cached_ids: Sequence[int] = (),
                  auto_state: Optional[dict] = None) -> Generator[StepResult, None, None]:
    """Decode from ``prompt`` (spec section 5): one :class:`StepResult` per target forward.

    Args:
        prompt: [P] int32 prompt ids, P >= 1. drafter: a bound drafter, or None (plain decoding).
        sampler: mlx-lm sampler over [N, V] log-probabilities or a :class:`~dflash_mlx.sampling.Sampling`
            (default greedy); it picks the acceptance rule (:func:`~.acceptance.choose_rule`).
        block_size, tree_budget: see :func:`~.width.make_chooser` (``stats.verify`` says what ran).
        prompt_lookup: also verify drafts copied from the context where they match (:mod:`.lookup`);
            ``cached_ids``: the ids ``prompt_cache`` holds before ``prompt``, context to copy from too.
        auto_state: what auto learned in earlier generations of the pair (:meth:`~.width.WidthChooser.state`), updated.
        stop: a :class:`~.stopping.StopCondition`, replacing ``max_tokens`` and ``stop_token_ids``.
        should_stop: checked before each prefill chunk; True raises ``PrefillStopped``.
        prompt_cache, draft_cache, stats: updated in place (default fresh; each result carries the stats);
            finished or closed, both caches hold every committed token but the last.

    Raises:
        InputError: empty prompt, max_tokens < 1, block size or tree budget out of range.
        RollbackError: ``prompt_cache`` cannot roll back exactly (before anything is generated).
        MismatchError: ``prompt_cache`` or the drafter's ``target_layer_ids`` do not fit the target.
    """
    sampler = sampler or greedy_sampler  # an empty prompt: InputError from BatchDecoder.start
    stop = stop or StopCondition(max_tokens, stop_token_ids)
    if stop.max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {stop.max_tokens}")
    B = check_block_size(block_size, drafter)
    tree_budget = parse_tree_budget(tree_budget)
    if tree_budget is not None and drafter is None:
        raise InputError("--tree-budget needs --draft-model (plain decoding has no drafts)")
    chooser = make_chooser(target, drafter, block_size, tree_budget) if drafter is not None else None
    if chooser is not None and auto_state:
        chooser.learn(auto_state)
    decoder, key = BatchDecoder(target, drafter, B, chooser, caches=OwnCaches(), lookup=prompt_lookup), object()
    if prompt_cache is not None:
        target.check_cache(prompt_cache, decoder.rows)
    joining = deque([decoder.start(key, prompt, sampler, stop, prefill_step_size, should_stop, cache=prompt_cache,
                                   draft_cache=draft_cache, stats=stats, history=cached_ids)])
    with mx.stream(generation_stream):
        try:
            while joining or decoder.sequences:
                for _, result in decoder.turn(joining):
                    if result.error is not None:
                        raise result.error
                    yield result
        finally:  # finished or closed: both caches hold the committed tokens but the last
            decoder.remove([key])
            if chooser is not None and auto_state is not None:
                auto_state.update(chooser.state())


def check_block_size(block_size: Optional[int | str], drafter: Optional[Drafter], flag: str = "--block-size") -> int:
    """B, the block the drafter drafts: 1 without a drafter, else 2..its trained size (that for None and
    ``"auto"``). Raises InputError naming ``flag`` and the allowed range."""
    if drafter is None:
        return 1
    trained = drafter.block_size
    block_size = parse_block_size(block_size)
    B = trained if block_size in (None, AUTO) else block_size
    if not 2 <= B <= trained:
        raise InputError(f"{flag} {B} is out of range: this drafter supports 2..{trained} "
                         f"(tokens a verify holds: the last one and up to {trained - 1} drafts)")
    return B


def stream_generate(target: TargetAdapter, tokenizer: TokenizerWrapper, prompt: mx.array | List[int],
                    drafter: Optional[Drafter] = None, *, max_tokens: int = 256, stop_strings: Sequence[str] = (),
                    **kwargs) -> Generator[GenerationResponse, None, None]:
    """Stream text as steps commit tokens: :func:`generate_step` (``kwargs``) through a :class:`TextStream`, stopping at
    the tokenizer's ``eos_token_ids``. The text stops before the first of ``stop_strings`` (text that could begin one is
    held back). The last response has ``finish_reason`` set and the final stats.
    """
    prompt = prompt if isinstance(prompt, mx.array) else mx.array(prompt, dtype=mx.int32)
    stop_ids = kwargs.pop("stop_token_ids", tuple(tokenizer.eos_token_ids))
    kwargs["stop"] = StopCondition(max_tokens, stop_ids, stop_strings, tokenizer.decode)
    text = TextStream(tokenizer, stop_strings)
    with wired_limit(target.model, [generation_stream]):
        for step in generate_step(prompt, target, drafter, **kwargs):
            segment = text.add(step.tokens, final=step.finish_reason is not None)
            yield GenerationResponse(segment, step.tokens, step.accepted, step.finish_reason, step.stats)


def generate(target: TargetAdapter, tokenizer: TokenizerWrapper, prompt: mx.array | List[int],
             drafter: Optional[Drafter] = None, **kwargs) -> Tuple[str, GenerationStats]:
    """Generate a whole response; returns ``(text, stats)``."""
    text, stats = "", None
    for response in stream_generate(target, tokenizer, prompt, drafter, **kwargs):
        text += response.text
        stats = response.stats
    return text, stats
