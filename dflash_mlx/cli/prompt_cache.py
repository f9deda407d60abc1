"""The prompt-cache flags shared by ``generate``, ``chat``, ``serve`` and ``bench``, and
the store they make (:class:`dflash_mlx.prompt_cache.store.PrefixStore`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dflash_mlx.errors import InputError
from dflash_mlx.ranges import check_number


def prompt_cache_dir_option():
    return typer.Option(
        None, "--prompt-cache-dir",
        help="Folder of the prompt cache on disk: the caches of prompts' prefixes, reused by later requests, "
        "processes and days. Default: $DFLASH_CACHE_DIR/prompts, else ~/.cache/dflash-mlx/prompts.",
    )


def no_prompt_cache_option():
    return typer.Option(False, "--no-prompt-cache",
                        help="Neither read nor write the prompt cache (every prompt is prefilled whole).")


def prompt_cache_gb_option():
    return typer.Option(8.0, "--prompt-cache-gb",
                        help="Most GB (2^30 bytes) the prompt cache keeps on disk; least recently used entries go first.")


def make_store(directory: Optional[str], off: bool, gb: float, warn=None):
    """The prompt cache the flags ask for, or None (``--no-prompt-cache``).

    Raises:
        InputError: ``--prompt-cache-gb`` not a finite number above 0, or ``--prompt-cache-dir`` a file.
    """
    check_number("--prompt-cache-gb", gb, above=0)
    if off:
        return None
    root = Path(directory).expanduser() if directory else None
    if root is not None and root.exists() and not root.is_dir():
        raise InputError(f"--prompt-cache-dir {root} is a file, not a folder")
    from dflash_mlx.prompt_cache.store import PrefixStore

    kwargs = {} if warn is None else {"warn": warn}
    return PrefixStore(root, max_bytes=int(gb * 2**30), **kwargs)
