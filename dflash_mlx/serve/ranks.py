"""``dflash serve`` under ``mlx.launch``: rank 0 answers HTTP; every other rank runs its engine's steps.

Rank 0 sends each job it admits (just before its prefill) and, at each check of a started job, whether it
stops; the others run the same steps on the same jobs, so every rank runs the same forwards and all-sums.
"""

import json
import logging
import random
import threading
import time
from dataclasses import asdict
from typing import Any, Optional

from ..pair.sharded import rank, share_text
from .jobs import GenerationJob

log = logging.getLogger("dflash.serve")


class Lockstep:
    """Rank 0 leads (``leader``); every method is a collective that all ranks call at the same point."""

    def __init__(self):
        self.leader = rank() == 0

    def send(self, spec: Optional[GenerationJob]) -> None:
        """Rank 0: the job about to start (None: the server stops); a sampled job without a seed gets one."""
        if not self.leader:
            return
        if spec is not None and spec.temperature > 0 and spec.seed is None:
            spec.seed = random.getrandbits(31)  # every rank draws the same tokens
        share_text(lambda: "" if spec is None else json.dumps(asdict(spec)))

    def end(self) -> None:
        """Rank 0: the server stops, and so do the other ranks (a warning where they are gone)."""
        try:
            self.send(None)
        except RuntimeError as e:  # a rank exited or its link broke
            log.warning("cannot tell the other ranks to stop: %s", e)

    def receive(self) -> Optional["FollowerJob"]:
        """The other ranks: the next job rank 0 sends, or None when the server stops."""
        text = share_text(lambda: "")
        return FollowerJob(GenerationJob(**json.loads(text))) if text else None


class _Nowhere:
    def call_soon_threadsafe(self, *args: Any) -> None:
        pass


class FollowerJob:
    """A job as the other ranks run it: rank 0 decides when it stops; its output goes nowhere."""

    prepare = None
    cancelled = threading.Event()
    _loop = _Nowhere()  # where push_together hands its chunks

    def __init__(self, spec: GenerationJob):
        self.spec, self.endpoint, self.id, self.submitted = spec, spec.endpoint, "follower", time.perf_counter()

    def should_stop(self) -> bool:
        return False

    def push(self, chunk: Any) -> None:
        pass
