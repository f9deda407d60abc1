"""A drafter wrapper that makes a known number of drafts right, at the real drafter's cost
(``--simulate-acceptance``), and the reader of acceptance traces to replay."""

from pathlib import Path
from typing import Any, List, Sequence, Union

import mlx.core as mx

from ..errors import InputError
from ..protocol import Drafter, WrappedDrafter
from .datasets import read_rows


class SimulatedDrafter(WrappedDrafter):
    """Runs ``drafter`` for its cost, then proposes ``sequence`` (prompt ids and the target's greedy continuation, by
    position) right for the first A slots of a block and ``(right + 1) % vocab_size`` after; ``accept`` is A or a cyclic
    trace of A per block. At temperature 0 each verify accepts ``min(A, B - 1)``.

    Raises:
        ValueError: a negative A or an empty trace.
    """

    def __init__(self, drafter: Drafter, sequence: Sequence[int], accept: Union[int, Sequence[int]], vocab_size: int):
        super().__init__(drafter)
        self.vocab_size = vocab_size
        self.reset(sequence, accept)

    def reset(self, sequence: Sequence[int], accept: Union[int, Sequence[int]]) -> None:
        """Script another generation with this same drafter (what the loop learned of it stays)."""
        trace = [accept] if isinstance(accept, int) else list(accept)
        if not trace or any(a < 0 for a in trace):
            raise ValueError(f"accept must be >= 0 (or a non-empty trace of such), got {accept}")
        self.sequence, self.trace, self.accept, self.blocks = list(sequence), trace, trace[0], 0

    def proposals(self, pos: int, block_size: int) -> List[int]:
        """Drafts d_1..d_{B-1} for a block whose ``t_last`` sits at ``pos``."""
        out = []
        for k in range(1, block_size):
            right = self.sequence[pos + k] if pos + k < len(self.sequence) else None
            out.append(0 if right is None else right if k <= self.accept else (right + 1) % self.vocab_size)
        return out

    def draft(self, token: mx.array, context: mx.array, cache: Sequence[Any], block_size: int) -> mx.array:
        """The scripted proposals, [B-1] int32, lazy and dependent on the real drafts."""
        pos = cache[0].offset + context.shape[1]
        self.accept = self.trace[self.blocks % len(self.trace)]
        self.blocks += 1
        real = self.inner.draft(token, context, cache, block_size)
        scripted = mx.array(self.proposals(pos, block_size), dtype=mx.int32)
        return mx.where(real < 0, real, scripted)  # argmax ids are never < 0


def read_trace(path: Union[str, Path]) -> List[int]:
    """Accepted lengths of ``dflash generate --json`` outputs' ``acceptance_trace`` (JSON lines
    joined), or of a JSON list of ints; raises InputError (flag and file) without counts >= 0."""
    where = f"--simulate-acceptance {path}"
    out: List[int] = []
    for row in read_rows(path, "--simulate-acceptance"):
        steps = row.get("acceptance_trace") if isinstance(row, dict) else [row]
        if not isinstance(steps, list):
            raise InputError(f"{where}: no acceptance_trace (write one with dflash generate --json)")
        for step in steps:
            a = step[0] if isinstance(step, list) and step else step
            if not isinstance(a, int) or isinstance(a, bool) or a < 0:
                raise InputError(f"{where}: acceptance_trace holds {step!r}, not a count >= 0")
            out.append(a)
    if not out:
        raise InputError(f"{where}: the acceptance trace is empty")
    return out
