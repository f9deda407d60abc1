"""A target sharded over the ranks of ``mx.distributed`` (``mlx.launch``), the drafter whole on every rank.

Under tensor parallelism every rank holds the same residual stream after each all-sum, so the
features, logits, acceptance and rollback agree on every rank; rank 0 alone reads and writes.
"""

import os
import random
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple, TypeVar

import mlx.core as mx

from ..errors import CheckpointError, InputError

SHARDINGS = ("tensor", "pipeline")
T = TypeVar("T")


def ranks() -> int:
    """How many processes ``mx.distributed`` joins (1 outside ``mlx.launch``)."""
    return mx.distributed.init().size()


def rank() -> int:
    """This process's rank (0 outside ``mlx.launch``)."""
    return mx.distributed.init().rank()


def _from_rank0(values: mx.array) -> mx.array:
    """``values`` as rank 0 holds them, on every rank (others pass zeros of the same shape)."""
    if rank() != 0:
        values = mx.zeros_like(values)
    return mx.distributed.all_sum(values, stream=mx.cpu)


def join_ranks(sharding: Optional[str]) -> Optional[dict]:
    """Under ``mlx.launch`` with more than one rank: check ``sharding`` (None: tensor), seed every rank alike,
    and quiet every rank but 0, which alone takes Ctrl-C (they run the same loop): their standard output
    goes nowhere, and of their standard error only one-line errors, named with the rank (mlx.launch stops
    the other ranks when one fails, so rank 0 may not live to say why).

    Returns:
        ``{"ranks": n, "sharding": sharding}`` (the ``--json`` field ``distributed``), or None for a single process.

    Raises:
        InputError: ``sharding`` is neither ``tensor`` nor ``pipeline``, or is given to a single process.
    """
    n = ranks()
    if n == 1:
        if sharding is not None:
            raise InputError("--sharding splits the target over the ranks of mlx.launch, and this is one process: "
                             "run under mlx.launch (e.g. mlx.launch --backend ring -n 2 -- dflash ...) or leave it out")
        return None
    sharding = sharding or "tensor"
    if sharding not in SHARDINGS:
        raise InputError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    mx.random.seed(int(_from_rank0(mx.array([random.getrandbits(31)]))[0].item()))
    if rank() != 0:
        sys.stdout, sys.stderr = open(os.devnull, "w"), ErrorsOnly(sys.stderr, rank())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every local rank
    return {"ranks": n, "sharding": sharding}


class ErrorsOnly:
    """Standard error of rank ``rank`` > 0: its ``error: ...`` lines, as ``error: rank N: ...``; nothing else."""

    def __init__(self, stream, rank: int):
        self.stream, self.rank, self.line = stream, rank, ""

    def write(self, text: str) -> int:
        *lines, self.line = (self.line + text).split("\n")
        for line in lines:
            if line.startswith("error: "):
                self.stream.write(f"error: rank {self.rank}: {line[len('error: '):]}\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def agreed(value: bool) -> bool:
    """Rank 0's ``value`` on every rank (one all-sum; every rank must call it at the same point)."""
    return bool(_from_rank0(mx.array([int(value)]))[0].item())


def lockstep(steps: Iterator[T]) -> Iterator[T]:
    """``steps`` on every rank, ended on all of them after the step where rank 0's consumer stopped (Ctrl-C,
    or closed it); a KeyboardInterrupt is raised there on every rank. In one process: ``steps`` as they are."""
    if ranks() == 1:
        yield from steps
        return
    stop = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(1))  # not in the middle of a collective
    going = True
    try:
        for step in steps:
            going = False
            yield step
            going = True
            if not agreed(not stop):
                raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous)
        if not going:  # rank 0 closed it at a yield: the others stop there too
            agreed(False)
        steps.close()


def refuse_ranks(command: str) -> None:
    """Raise InputError under ``mlx.launch`` with several ranks: ``command`` runs in one process only."""
    if ranks() > 1:
        raise InputError(f"{command} runs in one process, not under mlx.launch; dflash generate, chat and "
                         "serve do (the target split over the ranks)")


def share_text(read: Callable[[], str]) -> str:
    """``read()`` on rank 0, its text on every rank; a single process just calls it.

    Raises:
        What ``read`` raises, on rank 0; ``SystemExit(1)`` on the other ranks then.
    """
    if ranks() == 1:
        return read()
    data = b""
    if rank() == 0:
        try:
            data = read().encode()
        except BaseException:
            _from_rank0(mx.array([-1]))
            raise
    size = int(_from_rank0(mx.array([len(data)]))[0].item())
    if size < 0:
        raise SystemExit(1)
    if size == 0:
        return ""
    raw = mx.array(list(data), dtype=mx.int32) if data else mx.zeros((size,), mx.int32)
    return bytes(_from_rank0(raw).tolist()).decode()


def load_sharded(path: Path, sharding: str, model_type: str) -> Tuple[object, object]:
    """Load the mlx-lm model in ``path`` split over every rank (mlx-lm's ``sharded_load``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        InputError: the family cannot be split that way (names the folder and the reason).
        CheckpointError: the weights cannot be read.
    """
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    try:
        return sharded_load(str(path), tensor_group=group if sharding == "tensor" else None,
                            pipeline_group=group if sharding == "pipeline" else None)
    except ValueError as e:
        if "support" in str(e):
            fix = "use --sharding tensor" if sharding == "pipeline" else "run it in one process"
            raise InputError(f"{path}: a {model_type} target cannot be split with --sharding {sharding} "
                             f"({e}); {fix}") from None
        raise CheckpointError(f"{path}: cannot load the target model ({e})") from None

