"""A drafter wrapper that accepts a known number of drafts, at the real drafter's cost.

``--simulate-acceptance A`` measures the decode loop's speed at a chosen acceptance
on any target, including random-weight targets with a real model's shape: the
wrapped drafter runs its real forward pass (so drafting costs what it costs), then
its proposals are replaced by the target's own greedy continuation for the first A
positions of the block and by wrong tokens after them. At temperature 0 every
verify then accepts min(A, B-1) drafts, so tau = min(A, B-1) + 1, except where the
block reaches past the end of the known continuation.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import mlx.core as mx

from .protocol import Drafter, WrappedDrafter


class SimulatedDrafter(WrappedDrafter):
    """Wraps a drafter; proposes ``sequence`` right for ``accept`` slots, then wrong.

    Args:
        drafter: a bound drafter (``draft``, ``ingest``, ``make_cache``,
            ``block_size``, ``target_layer_ids``), run for its cost.
        sequence: prompt ids followed by the target's greedy continuation (from a
            plain greedy run), as absolute positions: ``sequence[p]`` is the token
            at position ``p``.
        accept: A, the number of leading drafts per block to make right (>= 0).
        vocab_size: the vocabulary size; a wrong token is ``(right + 1) % vocab_size``.

    The position of ``t_last`` is the drafter cache's offset plus the new context
    rows (the spec's invariant ``off + S``), so the wrapper needs no other state.
    """

    def __init__(self, drafter: Drafter, sequence: Sequence[int], accept: int, vocab_size: int):
        if accept < 0:
            raise ValueError(f"accept must be >= 0, got {accept}")
        super().__init__(drafter)
        self.sequence = list(sequence)
        self.accept = accept
        self.vocab_size = vocab_size

    def proposals(self, pos: int, block_size: int) -> List[int]:
        """Drafts d_1..d_{B-1} for a block whose ``t_last`` sits at ``pos``."""
        out = []
        for k in range(1, block_size):
            right = self.sequence[pos + k] if pos + k < len(self.sequence) else None
            if right is None:
                out.append(0)  # past the known continuation: any token
            elif k <= self.accept:
                out.append(right)
            else:
                out.append((right + 1) % self.vocab_size)
        return out

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        """Run the real drafter, then return the scripted proposals ([B-1] int32, lazy).

        The result depends on the real drafts (through a select that always picks
        the scripted token), so evaluating it evaluates the real forward pass.
        """
        pos = cache[0].offset + context.shape[1]
        real = self.inner.draft(token, context, cache, block_size)
        scripted = mx.array(self.proposals(pos, block_size), dtype=mx.int32)
        return mx.where(real < 0, real, scripted)  # argmax ids are never < 0
