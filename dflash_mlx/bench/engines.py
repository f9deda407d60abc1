"""What the bench times: engines that take prompt ids and yield lists of committed token ids, one
list per target forward. None of them detokenizes or reads the clock."""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from ..decode.generate import check_block_size, generate_step
from ..protocol import Drafter
from ..stats import GenerationStats
from ..targets.fused import unfused


class Engine:
    """A way to decode. ``name``: ``ar``, ``mlx-lm``, ``draft-model`` or ``dflash``;
    ``block_size``: its label in reports (1 for plain decoding)."""

    name = "engine"
    block_size: int | str = 1

    def stream(self, ids: List[int], max_tokens: int, sampler, stop_ids: Sequence[int],
               stats: GenerationStats) -> Iterator[List[int]]:
        raise NotImplementedError


class DFlashEngine(Engine):
    """This project's loop: DFlash with a drafter, plain decoding (``ar``) with None.

    Args:
        block_size: B (default: the drafter's trained size) or ``"auto"``.
        tree_budget: None (chains), N nodes or ``"auto"``.

    Its label is B, ``"auto"``, ``"tree N"`` or ``"auto+tree"``.
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, block_size: Optional[int | str] = None,
                 tree_budget: Optional[int | str] = None):
        self.target, self.drafter, self.tree_budget = target, drafter, tree_budget
        self.draft_block = check_block_size(block_size, drafter)
        self.verify_block = block_size if block_size == "auto" else self.draft_block
        if drafter is None:
            self.block_size, self.name = 1, "ar"
        else:
            self.name = "dflash"
            self.block_size = self.verify_block if tree_budget is None else \
                "auto+tree" if tree_budget == "auto" else f"tree {tree_budget}"

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        for step in generate_step(mx.array(ids, dtype=mx.int32), self.target, self.drafter, sampler=sampler,
                                  max_tokens=max_tokens, tree_budget=self.tree_budget, stop_token_ids=stop_ids,
                                  block_size=self.verify_block if self.drafter is not None else None, stats=stats):
            yield step.tokens


class MlxLmEngine(Engine):
    """Plain mlx-lm decoding (``mlx_lm.generate.generate_step``)."""

    name = "mlx-lm"

    def __init__(self, model):
        self.model = model

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        from mlx_lm.generate import generate_step as mlx_generate_step

        with unfused(self.model):  # mlx-lm's model as mlx-lm loads it
            steps = mlx_generate_step(mx.array(ids, dtype=mx.int32), self.model, max_tokens=max_tokens,
                                      sampler=sampler)
            for n, (token, _) in enumerate(steps):
                if n:  # the first token comes from prefill
                    stats.record_plain()
                if token in stop_ids:
                    yield []
                    return
                yield [token]


class MlxLmSpeculativeEngine(Engine):
    """mlx-lm speculative decoding with an autoregressive draft model of the target's vocabulary
    (``mlx_lm.generate.speculative_generate_step``); the tokens of one draft/verify cycle come as
    one list, so its acceptance histogram compares with DFlash's."""

    name = "draft-model"

    def __init__(self, model, draft_model, num_draft_tokens: int = 3):
        self.model, self.draft_model, self.num_draft_tokens = model, draft_model, num_draft_tokens
        self.block_size = num_draft_tokens + 1

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        from mlx_lm.generate import speculative_generate_step

        cycle: List[int] = []
        with unfused(self.model, self.draft_model):  # mlx-lm's models as mlx-lm loads them
            steps = speculative_generate_step(mx.array(ids, dtype=mx.int32), self.model, self.draft_model,
                                              num_draft_tokens=self.num_draft_tokens, max_tokens=max_tokens,
                                              sampler=sampler)
            for n, (token, _, from_draft) in enumerate(steps, 1):
                if token in stop_ids:
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
