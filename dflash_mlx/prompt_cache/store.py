"""The prefix cache's two levels: entries in memory (least recently used dropped first)
and on disk under one folder (a byte cap, least recently used dropped first).

Layout: ``ROOT/KEY/ID.safetensors`` + ``ROOT/KEY/ID.json`` (:mod:`dflash_mlx.prompt_cache.entry`),
where KEY names the pair (:func:`dflash_mlx.prompt_cache.key.key_id`, its identity kept in
``ROOT/KEY/key.json``) and ID the tokens. The byte cap counts every pair's entries under
ROOT. Use is recorded as the JSON file's modification time, so the order survives
processes. A lookup takes the entry that resumes the most rows of a prompt (longest
prefix, see :meth:`Snapshot.usable`); an entry that fails its checks on load is removed
with one warning line and the next best is tried.

Ownership: ROOT is claimed for the prompt cache (:func:`dflash_mlx.owned.claim`): a folder
that holds other files is left as it is and the cache lives in its ``dflash-prompt-cache``
subfolder. Clean-up and eviction touch only files named as the store names them (24 hex
digits) inside KEY folders (24 hex digits).

Failure: a write that fails (any errno, or MLX's RuntimeError) turns the store
memory-only for the rest of the process, with one warning line; :attr:`PrefixStore.state`
says so (``dflash serve`` reports it at ``/health``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..atomic import WriteError, atomic_file, pid_alive, stderr_warning
from ..owned import cache_root
from ..owned import MARKER, claim, mark
from .entry import CorruptEntry, Snapshot, read, read_index, usable_rows, write

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB on disk
DEFAULT_MEMORY_ENTRIES = 4
WRITER = "prompt-cache"
_OURS = re.compile(r"[0-9a-f]{24}")  # key folders and entry names (sha256 prefixes)


def default_root() -> Path:
    """``$DFLASH_CACHE_DIR/prompts``, else the user's cache folder's ``dflash-mlx/prompts``."""
    return cache_root() / "prompts"


def entry_name(tokens: Sequence[int]) -> str:
    """An entry's file name: 24 hex digits of the sha256 of its token ids."""
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:24]


class PrefixStore:
    """Prefix-cache entries of any number of pairs, in memory and on disk.

    Args:
        root: the folder (default :func:`default_root`); None with ``disk=False``: memory only.
        max_bytes: most bytes on disk under ``root`` (every pair's entries together; what other
            processes write is counted at the next scan, at most :attr:`RESCAN_S` seconds on).
        memory_entries: most entries kept in memory (0: none).
        disk: write and read entries on disk.
        warn: where one-line warnings go (a corrupt entry, a folder that cannot be written).

    Raises:
        InputError: ``root`` is a file, or holds other files and so does its
            ``dflash-prompt-cache`` subfolder.

    Attributes:
        root: the folder the entries are in (``root``, or its ``dflash-prompt-cache``).
        degraded: why the store is memory-only after all (None: it is not).
        hits: lookups answered, by level (``{"memory": n, "disk": n}``).
        last_level: the level that answered the last lookup (``"memory"``, ``"disk"``, None).
    """

    RESCAN_S = 30.0

    def __init__(self, root: Optional[Path] = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 memory_entries: int = DEFAULT_MEMORY_ENTRIES, disk: bool = True,
                 warn: Callable[[str], None] = stderr_warning):
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes, self.memory_entries, self.disk, self.warn = int(max_bytes), int(memory_entries), disk, warn
        self.memory: "OrderedDict[Tuple[str, str], Snapshot]" = OrderedDict()
        self.hits = {"memory": 0, "disk": 0}
        self.last_level: Optional[str] = None
        self._index: Dict[Path, Tuple[int, dict]] = {}  # json path -> (mtime_ns, parsed), read once
        self._clock = 0
        self.degraded: Optional[str] = None
        self._disk_bytes: Optional[int] = None  # every pair's bytes under root, as counted (see _evict_if_full)
        self._scanned_at = 0.0
        if self.disk:
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
        """``"disk (ROOT)"``, ``"memory-only (REASON)"`` after a failed write, or ``"memory-only"``."""
        if self.degraded is not None:
            return f"memory-only ({self.degraded})"
        return f"disk ({self.root})" if self.disk else "memory-only"

    def _degrade(self, e: OSError) -> None:
        """Stop writing to disk, with one warning line."""
        self.degraded = f"cannot write under {self.root}: {e.strerror or e}"
        self.warn(f"prompt cache: {self.degraded}; keeping entries in memory only")

    # -- lookup ------------------------------------------------------------------

    def lookup(self, kid: str, ids: Sequence[int]) -> Optional[Tuple[Snapshot, int]]:
        """The entry of pair ``kid`` that resumes the most rows of prompt ``ids``.

        Returns:
            ``(snapshot, rows)`` with ``rows >= 1`` (the snapshot may hold more tokens;
            trim to ``rows``), or None.
        """
        self.last_level = None
        found = [(snap.usable(ids), 1, name, None) for (k, name), snap in self.memory.items() if k == kid]
        in_memory = {name for _, _, name, _ in found}
        for path, index in self._disk_entries(kid):
            if path.stem not in in_memory:
                found.append((usable_rows(index["tokens"], index["layers"], ids), 0, path.stem, index))
        for rows, level, name, index in sorted(found, key=lambda f: (f[0], f[1], -len(f[3]["tokens"]) if f[3] else 0),
                                               reverse=True):
            if rows <= 0:
                return None
            snap = self._get(kid, name, index)
            if snap is not None:
                return snap, rows
        return None

    def _get(self, kid: str, name: str, index: Optional[dict]) -> Optional[Snapshot]:
        """Entry ``name`` from memory (index None) or disk, moved to most recently used."""
        if index is None:
            self.memory.move_to_end((kid, name))
            self.hits["memory"] += 1
            self.last_level = "memory"
            self._touch(self.root / kid / f"{name}.json")
            return self.memory[(kid, name)]
        folder = self.root / kid
        try:
            snap = read(folder, name, index)
        except CorruptEntry as e:
            self.warn(f"prompt cache: dropped a corrupt entry ({e})")
            self._remove(folder, name)
            return None
        self.hits["disk"] += 1
        self.last_level = "disk"
        self._touch(folder / f"{name}.json")
        self._remember(kid, name, snap)
        return snap

    # -- storing -----------------------------------------------------------------

    def put(self, kid: str, snap: Snapshot, key: Optional[dict] = None, disk: bool = True) -> None:
        """Keep ``snap`` for pair ``kid`` in memory and (``disk``) on disk, replacing an
        entry of the same tokens; then drop least recently used entries past the limits.
        ``key``: the pair's identity, written once to ``ROOT/KID/key.json`` for people."""
        if not snap.tokens:
            return
        name = entry_name(snap.tokens)
        self._remember(kid, name, snap)
        if not (disk and self.disk and self.degraded is None) or snap.nbytes > self.max_bytes:
            return
        folder = self.root / kid
        try:
            write(snap, folder, name)
            self._index.pop(folder / f"{name}.json", None)  # its side file is new: read it again
            if key is not None and not (folder / "key.json").exists():
                with atomic_file(folder / "key.json") as tmp:
                    tmp.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
            self._touch(folder / f"{name}.json")
            self._evict_if_full(folder, name)
        except OSError as e:  # WriteError included: any errno, or MLX's RuntimeError
            self._remove(folder, name)  # no half-written entry (new arrays beside an old JSON) stays
            self._degrade(e)

    def _remember(self, kid: str, name: str, snap: Snapshot) -> None:
        if self.memory_entries <= 0:
            return
        self.memory[(kid, name)] = snap
        self.memory.move_to_end((kid, name))
        while len(self.memory) > self.memory_entries:
            self.memory.popitem(last=False)

    def _evict_if_full(self, folder: Path, name: str) -> None:
        """After a write: :meth:`evict` when the bytes on disk may pass ``max_bytes``.
        The total is counted by the last scan plus what this process wrote since, so a
        server does not list and stat every entry after every request; a scan at least
        every :attr:`RESCAN_S` seconds counts what other processes wrote."""
        if self._disk_bytes is None or time.monotonic() - self._scanned_at > self.RESCAN_S:
            self.evict()
            return
        for suffix in (".json", ".safetensors"):
            self._disk_bytes += (folder / f"{name}{suffix}").stat().st_size
        if self._disk_bytes > self.max_bytes:
            self.evict()

    def evict(self) -> List[Path]:
        """Remove least recently used entries (every pair's) until the disk holds at most
        ``max_bytes``; returns the JSON paths removed."""
        entries = []
        for side in self.root.glob("*/*.json"):
            if not (_OURS.fullmatch(side.stem) and _OURS.fullmatch(side.parent.name)):
                continue
            try:
                st = side.stat()
                data = side.with_suffix(".safetensors").stat().st_size
            except OSError:
                data, st = 0, None
            if st is not None:
                entries.append((st.st_mtime_ns, side, st.st_size + data))
        total, removed = sum(e[2] for e in entries), []
        for _, side, size in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(side.parent, side.stem)
            self.memory.pop((side.parent.name, side.stem), None)
            total -= size
            removed.append(side)
        self._disk_bytes, self._scanned_at = total, time.monotonic()
        return removed

    # -- disk bookkeeping ----------------------------------------------------------

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
                    self.warn(f"prompt cache: dropped a corrupt entry ({e})")
                    self._remove(side.parent, side.stem)
                    continue
                self._index[side] = cached
            out.append((side, cached[1]))
        return out

    def _touch(self, side: Path) -> None:
        """Mark an entry used now (strictly after every earlier use in this process)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        try:
            os.utime(side, ns=(self._clock, self._clock))
            cached = self._index.get(side)
            if cached is not None:
                self._index[side] = (side.stat().st_mtime_ns, cached[1])
        except OSError:
            pass

    def _remove(self, folder: Path, name: str) -> None:
        for suffix in (".json", ".safetensors"):
            _unlink_file(folder / f"{name}{suffix}")
            self._index.pop(folder / f"{name}{suffix}", None)

    def _remove_leftovers(self) -> None:
        """Temporaries of writers that are gone (killed mid-write), and arrays files whose
        JSON was never written (the write was cut between the two renames): only files
        named as the store names them, in KEY folders."""
        try:
            folders = [f for f in self.root.iterdir() if _OURS.fullmatch(f.name) and f.is_dir()]
        except OSError:
            return
        for folder in folders:
            for tmp in folder.glob(".*.tmp-*"):
                base, _, pid = tmp.name.partition(".tmp-")
                stem, pid = base[1:].split(".", 1)[0], pid.split(".", 1)[0]
                if (stem == "key" or _OURS.fullmatch(stem)) and not (pid.isdigit() and pid_alive(int(pid))):
                    _unlink_file(tmp)
            for data in folder.glob("*.safetensors"):
                if _OURS.fullmatch(data.stem) and not data.with_suffix(".json").exists():
                    _unlink_file(data)


def _earlier_cache(root: Path) -> bool:
    """Whether ``root`` is a prompt cache written before folders were marked: unmarked,
    not empty, and nothing in it but KEY folders of entries, ``key.json`` and temporaries."""
    try:
        if (root / MARKER).exists() or not root.is_dir():
            return False
        folders = list(root.iterdir())
        names = [f.name for folder in folders for f in folder.iterdir()] if all(
            _OURS.fullmatch(f.name) and f.is_dir() for f in folders) else None
    except OSError:
        return False
    return bool(folders) and names is not None and all(
        n == "key.json" or ".tmp-" in n or (_OURS.fullmatch(n.rsplit(".", 1)[0]) and n.endswith((".json", ".safetensors")))
        for n in names)


def _unlink_file(path: Path) -> None:
    """Remove ``path`` when it is a file; a folder by that name, or a removal the system
    refuses, is left as it is."""
    try:
        if path.is_file():
            path.unlink()
    except OSError:
        pass
