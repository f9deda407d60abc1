"""The prefix cache in memory and on disk (``ROOT/KEY/ID.{json,safetensors}``, KEY the pair, ID the tokens,
last use as the JSON's mtime), least recently used dropped first; a failed write turns it memory-only."""

import json
import os
import re
import time
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..atomic import WriteError, pid_alive, stderr_warning, unlink_file, write_json
from ..owned import MARKER, cache_root, claim, mark
from .entry import CorruptEntry, Snapshot, read, read_index, usable_rows, write
from .key import key_id

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB on disk
DEFAULT_MEMORY_ENTRIES = 4
WRITER = "prompt-cache"
AUTO = "auto.json"  # in a KEY folder: what --block-size auto learned for the pair
_OURS = re.compile(r"[0-9a-f]{24}")  # key folders and entry names
_ENTRY_FILE = re.compile(r"[0-9a-f]{24}\.(?:json|safetensors)")  # an entry's two files


def default_root() -> Path:
    """``prompts`` under the cache root (``$DFLASH_CACHE_DIR``, else the user's ``dflash-mlx`` cache)."""
    return cache_root() / "prompts"


class PrefixStore:
    """Prefix-cache entries of any number of pairs, at most ``memory_entries`` in memory and ``max_bytes``
    on disk under ``root`` (default :func:`default_root`; other processes' writes counted within :attr:`RESCAN_S`).

    Raises:
        InputError: ``root`` is a file, or holds other files and so does its ``dflash-prompt-cache``.

    Attributes:
        root: the folder used (``root``, or its ``dflash-prompt-cache``); degraded: why it is memory-only, or None.
        hits: lookups answered per level; last_level: ``"memory"``, ``"disk"`` or None for the last lookup.
        disk_bytes: bytes of entries under ``root`` as counted (the last scan plus this store's writes); None before.
    """

    RESCAN_S = 30.0

    def __init__(self, root: Optional[Path] = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 memory_entries: int = DEFAULT_MEMORY_ENTRIES, warn: Callable[[str], None] = stderr_warning):
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes, self.memory_entries, self.disk, self.warn = int(max_bytes), int(memory_entries), True, warn
        self.memory: "OrderedDict[Tuple[str, str], Snapshot]" = OrderedDict()
        self.hits = {"memory": 0, "disk": 0}
        self.last_level: Optional[str] = None
        self._index: Dict[Path, Tuple[int, dict]] = {}  # json path -> (mtime_ns, parsed)
        self._clock = 0
        self.degraded: Optional[str] = None
        self.disk_bytes: Optional[int] = None
        self._scanned_at = 0.0
        try:
            if _earlier_cache(self.root):
                mark(self.root, WRITER)
            self.root = claim(self.root, WRITER, "--prompt-cache-dir")
        except WriteError as e:
            self.disk = False
            self._degrade(e)
            return
        self._remove_leftovers()

    @property
    def state(self) -> str:
        """``"disk (ROOT)"``, or ``"memory-only (REASON)"`` after a failed write."""
        return f"disk ({self.root})" if self.degraded is None else f"memory-only ({self.degraded})"

    def _degrade(self, e: OSError) -> None:
        """Stop writing to disk, with one warning line."""
        self.degraded = f"cannot write under {self.root}: {e.strerror or e}"
        self.warn(f"prompt cache: {self.degraded}; keeping entries in memory only")

    def lookup(self, kid: str, ids: Sequence[int]) -> Optional[Tuple[Snapshot, int]]:
        """``(snapshot, rows)``: pair ``kid``'s entry resuming the most rows (>= 1) of ``ids`` (trim it to
        ``rows``), or None; a corrupt entry is dropped with one warning and the next tried."""
        self.last_level = None
        found = {name: (usable_rows(snap.tokens, snap.layers, ids), 1, None)
                 for (k, name), snap in self.memory.items() if k == kid}
        for path, index in self._disk_entries(kid):
            found.setdefault(path.stem, (usable_rows(index["tokens"], index["layers"], ids), 0, index))
        order = sorted(found.items(), key=lambda f: (f[1][0], f[1][1], -len(f[1][2]["tokens"]) if f[1][2] else 0))
        for name, (rows, _, index) in reversed(order):
            if rows <= 0:
                return None
            if (snap := self._get(kid, name, index)) is not None:
                return snap, rows
        return None

    def _get(self, kid: str, name: str, index: Optional[dict]) -> Optional[Snapshot]:
        """Entry ``name`` from memory (index None) or disk, moved to most recently used."""
        folder, level = self.root / kid, "memory" if index is None else "disk"
        if index is None:
            self.memory.move_to_end((kid, name))
            snap = self.memory[(kid, name)]
        else:
            try:
                snap = read(folder, name, index)
            except CorruptEntry as e:
                self._drop_corrupt(folder, name, e)
                return None
            self._remember(kid, name, snap)
        self.hits[level] += 1
        self.last_level = level
        self._touch(folder / f"{name}.json")
        return snap

    def _drop_corrupt(self, folder: Path, name: str, e: CorruptEntry) -> None:
        self.warn(f"prompt cache: dropped a corrupt entry ({e})")
        self._remove(folder, name)

    def put(self, kid: str, snap: Snapshot, key: Optional[dict] = None, disk: bool = True) -> None:
        """Keep ``snap`` for pair ``kid`` in memory and (``disk``) on disk, then evict past the limits;
        ``key`` is written once to ``ROOT/KID/key.json``."""
        if not snap.tokens:
            return
        name = key_id(list(snap.tokens))
        self._remember(kid, name, snap)
        if not (disk and self.degraded is None) or snap.nbytes > self.max_bytes:
            return
        folder = self.root / kid
        try:
            write(snap, folder, name)
            self._index.pop(folder / f"{name}.json", None)  # its side file is new: read it again
            if key is not None and not (folder / "key.json").exists():
                write_json(folder / "key.json", key, indent=1, sort_keys=True)
            self._touch(folder / f"{name}.json")
            self._evict_if_full(folder, name)
        except OSError as e:  # WriteError included: any errno, or MLX's RuntimeError
            self._remove(folder, name)  # no half-written entry (new arrays beside an old JSON) stays
            self._degrade(e)

    def auto_state(self, kid: str) -> dict:
        """What ``--block-size auto`` learned for pair ``kid`` (``KID/auto.json``); {} if none (unreadable: warned)."""
        path = self.root / kid / AUTO
        try:
            state = json.loads(path.read_text()) if self.disk and path.is_file() else {}
        except (OSError, ValueError) as e:
            self.warn(f"prompt cache: ignored what auto learned before ({path}: {e})")
            return {}
        return state if isinstance(state, dict) else {}

    def put_auto_state(self, kid: str, state: dict) -> None:
        """Keep ``state`` for :meth:`auto_state` (a failed write turns the store memory-only, as for entries)."""
        try:
            if self.degraded is None:
                write_json(self.root / kid / AUTO, state, parents=True)
        except OSError as e:
            self._degrade(e)

    def _remember(self, kid: str, name: str, snap: Snapshot) -> None:
        if self.memory_entries <= 0:
            return
        self.memory[(kid, name)] = snap
        self.memory.move_to_end((kid, name))
        while len(self.memory) > self.memory_entries:
            self.memory.popitem(last=False)

    def _evict_if_full(self, folder: Path, name: str) -> None:
        """:meth:`evict` when the bytes on disk may pass ``max_bytes`` or the last scan is :attr:`RESCAN_S` old."""
        if self.disk_bytes is None or time.monotonic() - self._scanned_at > self.RESCAN_S:
            self.evict()
            return
        for suffix in (".json", ".safetensors"):
            self.disk_bytes += (folder / f"{name}{suffix}").stat().st_size
        if self.disk_bytes > self.max_bytes:
            self.evict()

    def evict(self) -> List[Path]:
        """Remove least recently used entries until the disk holds ``max_bytes``; returns the JSON paths removed."""
        entries = []
        for side in self.root.glob("*/*.json"):
            if not (_OURS.fullmatch(side.stem) and _OURS.fullmatch(side.parent.name)):
                continue
            try:
                st, data = side.stat(), side.with_suffix(".safetensors").stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, side, st.st_size + data.st_size))
        total, removed = sum(e[2] for e in entries), []
        for _, side, size in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(side.parent, side.stem)
            self.memory.pop((side.parent.name, side.stem), None)
            total -= size
            removed.append(side)
        self.disk_bytes, self._scanned_at = total, time.monotonic()
        return removed

    def _disk_entries(self, kid: str) -> List[Tuple[Path, dict]]:
        """``(json path, index)`` of pair ``kid``'s entries; an unreadable JSON is removed."""
        if not self.disk:
            return []
        out = []
        for side in sorted((self.root / kid).glob("*.json")):
            if not (_OURS.fullmatch(side.stem) and side.is_file()):
                continue
            try:
                mtime = side.stat().st_mtime_ns
            except OSError:
                continue
            cached = self._index.get(side)
            if cached is None or cached[0] != mtime:
                try:
                    cached = (mtime, read_index(side))
                except CorruptEntry as e:
                    self._drop_corrupt(side.parent, side.stem, e)
                    continue
                self._index[side] = cached
            out.append((side, cached[1]))
        return out

    def _touch(self, side: Path) -> None:
        """Mark an entry used now (strictly after every earlier use in this process)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        with suppress(OSError):
            os.utime(side, ns=(self._clock, self._clock))
            if (cached := self._index.get(side)) is not None:
                self._index[side] = (side.stat().st_mtime_ns, cached[1])

    def _remove(self, folder: Path, name: str) -> None:
        for suffix in (".json", ".safetensors"):
            unlink_file(folder / f"{name}{suffix}")
            self._index.pop(folder / f"{name}{suffix}", None)

    def _remove_leftovers(self) -> None:
        """Remove dead writers' temporaries and arrays files without their JSON (in KEY folders)."""
        try:
            folders = [f for f in self.root.iterdir() if _OURS.fullmatch(f.name) and f.is_dir()]
        except OSError:
            return
        for folder in folders:
            for tmp in folder.glob(".*.tmp-*"):
                base, _, pid = tmp.name.partition(".tmp-")
                stem, pid = base[1:].split(".", 1)[0], pid.split(".", 1)[0]
                if (stem in ("key", "auto") or _OURS.fullmatch(stem)) and not (pid.isdigit() and pid_alive(int(pid))):
                    unlink_file(tmp)
            for data in folder.glob("*.safetensors"):
                if _OURS.fullmatch(data.stem) and not data.with_suffix(".json").exists():
                    unlink_file(data)


def _earlier_cache(root: Path) -> bool:
    """Whether ``root`` is an unmarked, non-empty folder of nothing but KEY folders of our files (to mark)."""
    try:
        if (root / MARKER).exists() or not root.is_dir():
            return False
        folders = list(root.iterdir())
        names = [f.name for folder in folders for f in folder.iterdir()] if all(
            _OURS.fullmatch(f.name) and f.is_dir() for f in folders) else None
    except OSError:
        return False
    return bool(folders) and names is not None and all(
        n in ("key.json", AUTO) or ".tmp-" in n or _ENTRY_FILE.fullmatch(n) for n in names)
