"""What the bench times: each engine takes prompt ids and yields lists of committed token ids,
one list per target forward (DFlash, this loop without a drafter, mlx-lm plain and speculative).
Nothing here detokenizes or reads the clock; :mod:`dflash_mlx.bench.runner` does the timing."""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from ..decode.generate import check_block_size, generate_step
from ..protocol import Drafter
from ..stats import GenerationStats
from ..targets.fused import unfused


def variant_label(block_size, tree_budget) -> int | str:
    """A DFlash variant's name in reports: B (fixed chains), ``auto``, ``tree N``
    (fixed trees of N nodes) or ``auto+tree`` (widths and tree budgets by cost)."""
    if tree_budget is None:
        return block_size
    return "auto+tree" if tree_budget == "auto" else f"tree {tree_budget}"


class Engine:
    """A way to decode: ``stream`` yields lists of committed token ids.

    Attributes:
        name: ``ar``, ``mlx-lm``, ``draft-model`` or ``dflash``.
        block_size: tokens per target forward at most (1 for plain decoding).
    """

    name = "engine"
    block_size = 1

    def stream(self, ids: List[int], max_tokens: int, sampler, stop_ids: Sequence[int],
               stats: GenerationStats) -> Iterator[List[int]]:
        raise NotImplementedError


class DFlashEngine(Engine):
    """This project's engine: DFlash with a drafter, plain decoding (``ar``) without.

    Args:
        target: the target adapter.
        drafter: a bound drafter (or a :class:`SimulatedDrafter`), or None for ``ar``.
        block_size: B (default: the drafter's trained block size), or ``"auto"``.
        tree_budget: None (chains), a tree budget N, or ``"auto"``.

    ``block_size`` is the report's label of this variant: B for fixed chains, else
    ``"auto"``, ``"tree N"`` or ``"auto+tree"`` (see :func:`variant_label`).
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, block_size: Optional[int | str] = None,
                 tree_budget: Optional[int | str] = None):
        self.target, self.drafter = target, drafter
        self.draft_block = check_block_size(block_size, drafter)
        self.verify_block = block_size if block_size == "auto" else self.draft_block
        self.tree_budget = tree_budget
        self.block_size = variant_label(self.verify_block, tree_budget) if drafter is not None else 1
        self.name = "dflash" if drafter is not None else "ar"

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        prompt = mx.array(ids, dtype=mx.int32)
        for step in generate_step(prompt, self.target, self.drafter, sampler=sampler, max_tokens=max_tokens,
                                  block_size=self.verify_block if self.drafter is not None else None,
                                  tree_budget=self.tree_budget, stop_token_ids=stop_ids, stats=stats):
            yield step.tokens


class MlxLmEngine(Engine):
    """Plain mlx-lm decoding (``mlx_lm.generate.generate_step``, what its
    ``stream_generate`` runs)."""

    name = "mlx-lm"

    def __init__(self, model):
        self.model = model

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        from mlx_lm.generate import generate_step as mlx_generate_step

        stops = set(stop_ids)
        prompt = mx.array(ids, dtype=mx.int32)
        with unfused(self.model):  # mlx-lm's model as mlx-lm loads it
            for n, (token, _) in enumerate(mlx_generate_step(prompt, self.model, max_tokens=max_tokens,
                                                             sampler=sampler)):
                if n:  # the first token comes from prefill
                    stats.record_plain()
                if token in stops:
                    yield []
                    return
                yield [token]


class MlxLmSpeculativeEngine(Engine):
    """mlx-lm speculative decoding with an autoregressive draft model
    (``mlx_lm.generate.speculative_generate_step``).

    Tokens of one draft/verify cycle are yielded as one list (a cycle ends with
    the target's own token), so its acceptance histogram is comparable to DFlash's.

    Args:
        model: the target mlx-lm model.
        draft_model: a small mlx-lm model with the target's vocabulary.
        num_draft_tokens: drafts per cycle (mlx-lm's CLI default is 3).
    """

    name = "draft-model"

    def __init__(self, model, draft_model, num_draft_tokens: int = 3):
        self.model, self.draft_model, self.num_draft_tokens = model, draft_model, num_draft_tokens
        self.block_size = num_draft_tokens + 1

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        from mlx_lm.generate import speculative_generate_step

        stops = set(stop_ids)
        prompt = mx.array(ids, dtype=mx.int32)
        cycle: List[int] = []
        n = 0
        with unfused(self.model, self.draft_model):  # mlx-lm's models as mlx-lm loads them
            for token, _, from_draft in speculative_generate_step(
                prompt, self.model, self.draft_model, num_draft_tokens=self.num_draft_tokens,
                max_tokens=max_tokens, sampler=sampler,
            ):
                n += 1
                if token in stops:
                    stats.record_step(len(cycle), self.num_draft_tokens)
                    yield cycle
                    return
                cycle.append(token)
                if not from_draft or n == max_tokens:
                    stats.record_step(min(len(cycle) - 1, self.num_draft_tokens), self.num_draft_tokens)
                    yield cycle
                    cycle = []
            if cycle:
                yield cycle
