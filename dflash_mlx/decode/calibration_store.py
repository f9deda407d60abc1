"""Calibrations kept between processes: one small JSON file per (target, drafter, device,
dtypes, versions) under the user's cache folder, holding the calibrated seconds
(:mod:`dflash_mlx.decode.calibration`) and the drafter's acceptance profile of earlier runs, so a
new process starts calibrated and with that profile instead of a prior.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from ..atomic import atomic_file, stderr_warning
from ..errors import InputError
from ..owned import claim, marked

STORE_FORMAT = 3  # 3: medians of interleaved rounds, and the per-width step factors
CACHE_ENV = "DFLASH_CACHE_DIR"
WRITER = "calibration"
_WARNED: set = set()  # roots whose failed write was reported (one warning per process)


def cache_root() -> Path:
    """The user's cache folder for dflash-mlx: ``$DFLASH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx`` (beside the Hugging
    Face cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dflash-mlx"


@functools.lru_cache(maxsize=None)
def device_name() -> str:
    """The device MLX computes on, precise enough that timings from another machine
    are not reused (GPU name, or CPU architecture, model and core count)."""
    device = mx.default_device()
    if device == mx.gpu and mx.metal.is_available():
        try:
            return f"gpu {mx.metal.device_info().get('device_name', '')}"
        except Exception:  # older MLX without device_info
            return "gpu"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu {platform.machine()} {cpu} x{usable}"  # the cores this process may use (taskset)


def store_key(target, drafter, draft_block: int, widths: Sequence[int]) -> Optional[dict]:
    """What a stored calibration must match to be reused, or None when the target or
    the drafter has no ``fingerprint`` (built in memory, or a wrapper such as the
    simulated drafter: not loaded from a folder).

    Args:
        target: a :class:`~dflash_mlx.targets.TargetAdapter` from :func:`dflash_mlx.load`.
        drafter: a :class:`~dflash_mlx.drafter.network.DFlashDrafter` from :func:`dflash_mlx.load`.
        draft_block, widths: the block drafted and the widths timed.
    """
    target_id, drafter_id = getattr(target, "fingerprint", None), getattr(drafter, "fingerprint", None)
    if not target_id or not drafter_id:  # wrapped drafters (simulated, scripted) have none: never stored
        return None
    import mlx_lm

    from .. import __version__

    return {
        "format": STORE_FORMAT,
        "dflash_mlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": device_name(),
        "target": target_id,
        "target_dtype": str(target.dtype),
        "drafter": drafter_id,
        "drafter_dtype": str(drafter.fc.weight.dtype) if hasattr(drafter, "fc") else None,
        "draft_window": list(getattr(drafter, "draft_window", None) or []),
        "draft_block": draft_block,
        "widths": sorted(set(widths)),
    }


class CalibrationStore:
    """Calibrations and acceptance profiles on disk, one JSON file per key
    (``<root>/calibration/<sha256 of the key>.json``).

    Writes go to a temporary file renamed into place, so a kill never leaves half a
    file; a file that does not parse, or whose key differs, is ignored (and later
    overwritten). The ``calibration`` folder is claimed (:func:`dflash_mlx.owned.claim`):
    one that holds other files is left as it is and its ``dflash-calibration`` subfolder
    is used.

    Args:
        root: the cache folder (default :func:`cache_root`).
    """

    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_root()

    def path(self, key: dict) -> Path:
        """Where ``key``'s state is read from (the claimed folder when it is there)."""
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
        folder = self.root / "calibration"
        if not marked(folder, WRITER) and marked(folder / f"dflash-{WRITER}", WRITER):
            folder = folder / f"dflash-{WRITER}"
        return folder / f"{name}.json"

    def load(self, key: dict) -> Optional[dict]:
        """The stored state for ``key``, or None (none stored, unreadable, or stale)."""
        try:
            entry = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("state"), dict):
            return None
        return entry["state"]

    def save(self, key: dict, state: dict) -> bool:
        """Write ``state`` for ``key`` atomically; False (and nothing written) when the
        folder cannot be written, any errno, or holds other files in both places
        :func:`~dflash_mlx.owned.claim` tries. The first failure under a root prints one
        warning; decoding goes on (a later process calibrates again)."""
        path = self.path(key)
        try:
            folder = claim(path.parent, WRITER, "$DFLASH_CACHE_DIR/calibration")
            with atomic_file(folder / path.name) as tmp:
                tmp.write_text(json.dumps({"key": key, "state": state, "saved": time.time()}))
            return True
        except (OSError, InputError) as e:  # WriteError: any errno
            if self.root not in _WARNED:
                _WARNED.add(self.root)
                stderr_warning(f"calibration not kept ({e}); --block-size auto calibrates again in the next process")
            return False
