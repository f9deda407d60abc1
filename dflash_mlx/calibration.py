"""Where the cost model's seconds come from, and what it keeps between processes.

``--block-size auto`` chooses widths by seconds per step. Those seconds come from a
:class:`Timings` source, injected into the policy:

- :class:`MeasuredTimings` (the default): this machine's clock. A target forward of
  each width and a drafter pass are timed once on scratch caches
  (:func:`calibrate`), then every real step reports its wall time.
- :class:`FixedTimings`: seconds given up front, the same for every step of a mode
  and width whatever the clock says. Tests use it, so what they check never depends
  on how busy the machine is; simulations use it to replay a known cost.

A :class:`CalibrationStore` keeps, per (target, drafter, device, dtypes, versions),
the calibrated seconds and what the drafter's acceptance looked like in earlier
runs, as one small JSON file under the user's cache folder, so a new process starts
calibrated and with the drafter's own acceptance profile instead of a prior.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Protocol, Sequence

import mlx.core as mx

PLAIN = "plain"  # the cost model's mode names (dflash_mlx.cost)
TIMED_REPEATS = 3
STORE_FORMAT = 1
CACHE_ENV = "DFLASH_CACHE_DIR"


@dataclass
class Calibration:
    """Seconds of the pieces of a step, as timed (or given) before decoding.

    Attributes:
        verify_s: ``{n: seconds}`` of a target forward of n tokens (features and
            logits included); n = 1 is a plain decoding step.
        draft_s: seconds of one drafter pass at the drafted block size.
    """

    verify_s: Dict[int, float]
    draft_s: float


class Timings(Protocol):
    """A source of seconds for the cost model (see the module doc).

    Attributes:
        measured: whether the seconds are this machine's (then worth keeping).
        store: a :class:`CalibrationStore` keeping calibrations between processes, or None.
    """

    measured: bool
    store: Optional["CalibrationStore"]

    def calibrate(self, target, drafter, draft_block: int, widths: Sequence[int]) -> Calibration:
        """Seconds of a forward of each width in ``widths`` and of one drafter pass."""

    def step(self, mode: str, width: int, wall_s: float) -> float:
        """The seconds a real step of ``mode`` feeding ``width`` tokens counts for,
        given its measured ``wall_s``."""


class MeasuredTimings:
    """This machine's clock: :func:`calibrate`, then each step's wall time.

    Args:
        store: where calibrations are kept between processes (default: a
            :class:`CalibrationStore` in the user's cache folder).
    """

    measured = True

    def __init__(self, store: Optional["CalibrationStore"] = None):
        self._store = store

    @property
    def store(self) -> "CalibrationStore":
        return self._store if self._store is not None else CalibrationStore()

    def calibrate(self, target, drafter, draft_block: int, widths: Sequence[int]) -> Calibration:
        return calibrate(target, drafter, draft_block, widths)

    def step(self, mode: str, width: int, wall_s: float) -> float:
        return wall_s


class FixedTimings:
    """Seconds fixed up front: a forward of n tokens takes ``forward_s(n)``, a
    drafter pass ``draft_s``, and every step counts for exactly that (plain steps:
    the forward; chains and trees: the forward plus the drafter pass), whatever its
    wall time.

    Args:
        forward_s: seconds of a target forward of n tokens (default 1 ms + 0.05 ms
            per token: wide verifies are cheap, as on a GPU).
        draft_s: seconds of a drafter pass (default 1 ms).
    """

    measured = False
    store = None  # fixed seconds are not worth keeping

    def __init__(self, forward_s: Optional[Callable[[int], float]] = None, draft_s: float = 1e-3):
        self.forward_s = forward_s or (lambda n: 1e-3 + 5e-5 * n)
        self.draft_s = draft_s

    def calibrate(self, target, drafter, draft_block: int, widths: Sequence[int]) -> Calibration:
        return Calibration({n: self.forward_s(n) for n in widths}, self.draft_s)

    def step(self, mode: str, width: int, wall_s: float) -> float:
        return self.forward_s(width) + (0.0 if mode == PLAIN else self.draft_s)


def calibrate(target, drafter, draft_block: int, widths: Sequence[int], context_rows: int = 64) -> Calibration:
    """Time the target's forward at each width and one drafter pass on scratch caches
    (the real caches are never touched): the median of a few runs after a warm-up.

    Args:
        target: a :class:`~dflash_mlx.targets.TargetAdapter`.
        drafter: a bound drafter; its pass is timed at ``draft_block``.
        widths: tokens per forward to time (1 = a plain step).
        context_rows: rows in the scratch caches before timing.
    """
    V = target.vocab_size
    context = mx.arange(context_rows, dtype=mx.int32) % V
    cache = target.make_cache(max(widths))
    _, features = target(context[None], cache, drafter.target_layer_ids)
    mx.eval([c.state for c in cache], features)
    token = mx.array([1], dtype=mx.int32)
    times: Dict[int, float] = {}
    for n in sorted(set(widths)):
        runs = []
        for _ in range(TIMED_REPEATS + 1):
            tic = time.perf_counter()
            h, f = target(mx.full((1, n), 1, dtype=mx.int32), cache, drafter.target_layer_ids)
            mx.eval(target.lm_head(h), f)
            runs.append(time.perf_counter() - tic)
            target.rollback(cache, n)
        times[n] = statistics.median(runs[1:])
    runs = []
    for _ in range(TIMED_REPEATS + 1):
        draft_cache = drafter.make_cache()
        tic = time.perf_counter()
        mx.eval(drafter.draft(token, features, draft_cache, draft_block))
        runs.append(time.perf_counter() - tic)
    return Calibration(times, statistics.median(runs[1:]))


# ----------------------------------------------------------------------------- the store


def cache_root() -> Path:
    """The user's cache folder for dflash-mlx: ``$DFLASH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx`` (beside the Hugging
    Face cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dflash-mlx"


def folder_fingerprint(folder: str | Path) -> str:
    """A cheap identity of a model folder: sha256 of ``config.json``'s bytes and of
    each weight file's resolved name, size and modification time (a changed or
    re-downloaded checkpoint gets a new fingerprint; its gigabytes are not read).

    Raises:
        OSError: the folder cannot be listed.
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        digest.update(f"{path.name}:{path.resolve().name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


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
    return f"cpu {platform.machine()} {cpu} x{os.cpu_count()}"


def store_key(target, drafter, draft_block: int, widths: Sequence[int]) -> Optional[dict]:
    """What a stored calibration must match to be reused, or None when the target or
    the drafter has no ``fingerprint`` (built in memory, or a wrapper such as the
    simulated drafter: not loaded from a folder).

    Args:
        target: a :class:`~dflash_mlx.targets.TargetAdapter` from :func:`dflash_mlx.load`.
        drafter: a :class:`~dflash_mlx.drafter.DFlashDrafter` from :func:`dflash_mlx.load`.
        draft_block, widths: the block drafted and the widths timed.
    """
    target_id, drafter_id = getattr(target, "fingerprint", None), getattr(drafter, "fingerprint", None)
    if not target_id or not drafter_id:  # wrapped drafters (simulated, scripted) have none: never stored
        return None
    import mlx_lm

    from . import __version__

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
    overwritten).

    Args:
        root: the cache folder (default :func:`cache_root`).
    """

    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_root()

    def path(self, key: dict) -> Path:
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
        return self.root / "calibration" / f"{name}.json"

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
        folder cannot be written (a read-only home is not an error)."""
        path, tmp = self.path(key), None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "state": state, "saved": time.time()}, f)
            os.replace(tmp, path)
            return True
        except OSError:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False
