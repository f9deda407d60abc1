"""What the bench times: engines that take prompt ids and yield lists of committed token ids, one
list per target forward. None of them detokenizes or reads the clock."""

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
    """This project's loop: DFlash with a drafter (``block_size`` B, None: trained, or ``"auto"``;
    ``tree_budget`` None, N or ``"auto"``), plain decoding (``ar``) without one."""

    def __init__(self, target, drafter: Optional[Drafter] = None, block_size: Optional[int | str] = None,
                 tree_budget: Optional[int | str] = None, prompt_lookup: bool = False):
        self.target, self.drafter, self.tree_budget = target, drafter, tree_budget
        self.prompt_lookup = prompt_lookup and drafter is not None  # the plain baseline stays plain
        self.draft_block = check_block_size(block_size, drafter)
        self.verify_block = block_size if block_size == "auto" else self.draft_block
        self.name = "dflash" if drafter is not None else "ar"
        if drafter is None or tree_budget is None:
            self.block_size = self.verify_block if drafter is not None else 1
        else:
            self.block_size = "auto+tree" if tree_budget == "auto" else f"tree {tree_budget}"

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        for step in generate_step(mx.array(ids, dtype=mx.int32), self.target, self.drafter, sampler=sampler,
                                  max_tokens=max_tokens, tree_budget=self.tree_budget, stop_token_ids=stop_ids,
                                  block_size=self.verify_block if self.drafter is not None else None, stats=stats,
                                  prompt_lookup=self.prompt_lookup):
            yield step.tokens


class MlxLmEngine(Engine):
    """mlx-lm decoding: plain (``name`` ``mlx-lm``), or speculative with an autoregressive
    ``draft_model`` of the target's vocabulary (``draft-model``), each draft/verify cycle's tokens
    one list so that its acceptance histogram compares with DFlash's."""

    def __init__(self, model, draft_model=None, num_draft_tokens: int = 3):
        self.model, self.draft_model, self.num_draft_tokens = model, draft_model, num_draft_tokens
        self.name = "mlx-lm" if draft_model is None else "draft-model"
        self.block_size = 1 if draft_model is None else num_draft_tokens + 1

    def _steps(self, ids: List[int], max_tokens: int, sampler) -> Iterator[tuple]:
        """``(token, from_draft)`` pairs."""
        from mlx_lm.generate import generate_step as plain, speculative_generate_step as speculative

        prompt = mx.array(ids, dtype=mx.int32)
        if self.draft_model is None:
            return ((t, False) for t, _ in plain(prompt, self.model, max_tokens=max_tokens, sampler=sampler))
        steps = speculative(prompt, self.model, self.draft_model, num_draft_tokens=self.num_draft_tokens,
                            max_tokens=max_tokens, sampler=sampler)
        return ((t, from_draft) for t, _, from_draft in steps)

    def stream(self, ids, max_tokens, sampler, stop_ids, stats):
        cycle: List[int] = []
        with unfused(self.model, *([self.draft_model] if self.draft_model is not None else [])):
            for n, (token, from_draft) in enumerate(self._steps(ids, max_tokens, sampler), 1):
                stopped = token in stop_ids
                cycle += [] if stopped else [token]
                if stopped or not from_draft or n == max_tokens:
                    if self.draft_model is None and n > 1:  # the first token comes from prefill
                        stats.record_plain()
                    elif self.draft_model is not None:
                        accepted = len(cycle) if stopped else min(len(cycle) - 1, self.num_draft_tokens)
                        stats.record_step(accepted, self.num_draft_tokens)
                    yield cycle
                    if stopped:
                        return
                    cycle = []
        if cycle:
            yield cycle
