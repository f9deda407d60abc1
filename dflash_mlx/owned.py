"""Folders dflash-mlx writes in, marked as a writer's own (``.dflash-mlx``, JSON ``{"writer": NAME}``),
so that clean-up runs only there, and only on names of the writer's own pattern."""

import json
import os
from pathlib import Path

from .atomic import write_error, write_json
from .errors import InputError

MARKER = ".dflash-mlx"
CACHE_ENV = "DFLASH_CACHE_DIR"


def cache_root() -> Path:
    """The user's cache folder for dflash-mlx: ``$DFLASH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dflash-mlx"


def marked(folder: Path, writer: str) -> bool:
    """Whether ``folder`` carries ``writer``'s marker (never raises)."""
    try:
        return json.loads((Path(folder) / MARKER).read_text()).get("writer") == writer
    except (OSError, ValueError, AttributeError):
        return False


def _empty(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def claim(folder: Path, writer: str, flag: str) -> Path:
    """The folder ``writer`` writes in: ``folder`` when it is new, empty or marked as ``writer``'s, else
    ``folder/dflash-WRITER`` under the same rule; created and marked when needed.

    Raises:
        InputError: ``folder`` is a file, or it and its ``dflash-WRITER`` hold others' files (names ``flag``).
        WriteError: the folder cannot be created or marked.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{flag} {folder} is a file, not a folder")
    if marked(folder, writer):
        return folder
    try:
        if not _empty(folder):
            sub = folder / f"dflash-{writer}"
            if sub.exists() and not (sub.is_dir() and (marked(sub, writer) or _empty(sub))):
                raise InputError(f"{flag} {folder} holds files of others, and so does {sub}; give a folder of its own")
            folder = sub
            if marked(folder, writer):
                return folder
        mark(folder, writer)
    except OSError as e:  # a folder that cannot be listed counts as one that cannot be written
        raise write_error(e, folder) from e
    return folder


def mark(folder: Path, writer: str) -> None:
    """Create ``folder`` when missing and mark it as ``writer``'s; raises ``WriteError`` when it cannot."""
    write_json(Path(folder) / MARKER, {"writer": writer}, parents=True)
