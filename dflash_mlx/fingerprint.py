"""A model folder's identity, cheap to compute: what keys prompt-cache entries to a checkpoint.

A shared leaf (imports nothing of the package): ``pair/loading.py`` and ``drafter/checkpoint.py``
stamp each loaded model with it (``.fingerprint``); ``prompt_cache/key.py`` reads the stamps. Whole files
are hashed by :func:`sha256_file` (a converted folder's manifest, a prompt-cache entry's arrays).
"""

import hashlib
from pathlib import Path


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
    digest.update("".join(file_identity(path) for path in sorted(folder.glob("*.safetensors"))).encode())
    return digest.hexdigest()[:32]


def file_identity(path: Path) -> str:
    """A file's name, resolved name, size and modification time: who it is, unread (OSError: unreadable)."""
    st = path.stat()
    return f"{path.name}:{path.resolve().name}:{st.st_size}:{st.st_mtime_ns}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
