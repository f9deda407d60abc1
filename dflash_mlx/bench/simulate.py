"""A drafter wrapper that accepts a known number of drafts, at the real drafter's cost.

``--simulate-acceptance A`` measures the decode loop's speed at a chosen acceptance
on any target, including random-weight targets with a real model's shape: the
wrapped drafter runs its real forward pass (so drafting costs what it costs), then
its proposals are replaced by the target's own greedy continuation for the first A
positions of the block and by wrong tokens after them. At temperature 0 every
verify then accepts min(A, B-1) drafts, so tau = min(A, B-1) + 1, except where the
block reaches past the end of the known continuation.

A replayed **acceptance trace** (a list of A values, one per drafted block, in
order, e.g. the accepted lengths a real run recorded in ``--json``'s
``acceptance_trace``) gives real, varying acceptance at any target's shape: the k-th
block drafted makes its first ``trace[k mod len(trace)]`` drafts right.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Sequence, Union

import mlx.core as mx

from ..protocol import Drafter, WrappedDrafter


class SimulatedDrafter(WrappedDrafter):
    """Wraps a drafter; proposes ``sequence`` right for ``accept`` slots, then wrong.

    Args:
        drafter: a bound drafter (``draft``, ``ingest``, ``make_cache``,
            ``block_size``, ``target_layer_ids``), run for its cost.
        sequence: prompt ids followed by the target's greedy continuation (from a
            plain greedy run), as absolute positions: ``sequence[p]`` is the token
            at position ``p``.
        accept: A, the number of leading drafts per block to make right (>= 0), or a
            trace of A values (non-empty), the k-th for the k-th block drafted.
        vocab_size: the vocabulary size; a wrong token is ``(right + 1) % vocab_size``.

    The position of ``t_last`` is the drafter cache's offset plus the new context
    rows (the spec's invariant ``off + S``), so the wrapper needs no other state.
    """

    def __init__(self, drafter: Drafter, sequence: Sequence[int], accept: Union[int, Sequence[int]],
                 vocab_size: int):
        super().__init__(drafter)
        self.vocab_size = vocab_size
        self.reset(sequence, accept)

    def reset(self, sequence: Sequence[int], accept: Union[int, Sequence[int]]) -> None:
        """Script another generation (another prompt's continuation, trace) with this
        same drafter, so what the decode loop learned of it carries over, as it does
        for a real drafter across generations."""
        trace = [accept] if isinstance(accept, int) else list(accept)
        if not trace or any(a < 0 for a in trace):
            raise ValueError(f"accept must be >= 0 (or a non-empty trace of such), got {accept}")
        self.sequence = list(sequence)
        self.trace = trace
        self.accept = trace[0]
        self.blocks = 0  # blocks drafted so far: the trace's index

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
        self.accept = self.trace[self.blocks % len(self.trace)]
        self.blocks += 1
        real = self.inner.draft(token, context, cache, block_size)
        scripted = mx.array(self.proposals(pos, block_size), dtype=mx.int32)
        return mx.where(real < 0, real, scripted)  # argmax ids are never < 0


def read_trace(path: Union[str, Path]) -> List[int]:
    """The accepted lengths of an acceptance trace file: ``dflash generate --json``'s
    output (its ``acceptance_trace``: ``[[accepted, drafted], ...]``), one such output
    per line (JSON lines, traces joined), or a JSON list of ints.

    Raises:
        ValueError: naming the file, when it holds no trace of counts >= 0.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable acceptance trace ({e})") from None
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        try:  # JSON lines: one --json output per line
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON or JSON lines ({e})") from None
    out: List[int] = []
    for doc in docs:
        steps = doc.get("acceptance_trace") if isinstance(doc, dict) else doc
        if not isinstance(steps, list):
            raise ValueError(f"{path}: no acceptance_trace (write one with dflash generate --json)")
        for step in steps:
            a = step[0] if isinstance(step, list) and step else step
            if not isinstance(a, int) or isinstance(a, bool) or a < 0:
                raise ValueError(f"{path}: acceptance_trace holds {step!r}, not a count >= 0")
            out.append(a)
    if not out:
        raise ValueError(f"{path}: the acceptance trace is empty")
    return out
