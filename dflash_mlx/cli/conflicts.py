"""Other installed distributions that also provide a ``dflash`` command or a ``dflash_mlx`` package."""

from __future__ import annotations

import importlib.metadata as md
import re
from typing import Iterable, List, Optional

OUR_ENTRY_POINT = "dflash_mlx.cli.main:main"
PACKAGE = "dflash_mlx"
COMMAND = "dflash"


def _provides_package(dist: md.Distribution) -> bool:
    top = dist.read_text("top_level.txt")
    if top is not None:
        return PACKAGE in top.split()
    return any(str(f).split("/")[0] == PACKAGE for f in (dist.files or []))


def conflicts(dists: Optional[Iterable[md.Distribution]] = None) -> List[str]:
    """One description per clashing distribution (name, version, what it provides, where); ours (whose
    ``dflash`` is :data:`OUR_ENTRY_POINT`, an editable install maybe listed twice) are skipped."""
    found = []
    for dist in md.distributions() if dists is None else dists:
        try:
            scripts = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == COMMAND]
            if any(ep.value == OUR_ENTRY_POINT for ep in scripts):
                continue
            what = []
            if scripts:
                what.append(f"a '{COMMAND}' command ({scripts[0].value})")
            if _provides_package(dist):
                what.append(f"a '{PACKAGE}' package")
        except Exception:  # a broken dist-info must not stop the CLI
            continue
        if what:
            name, version = dist.metadata["Name"], dist.version
            where = getattr(dist, "_path", None)
            found.append(f"{name} {version} ({' and '.join(what)}; {where})")
    return found


def warning(found: List[str]) -> Optional[str]:
    """The one-line warning for :func:`conflicts`' result, or None."""
    if not found:
        return None
    names = ", ".join(found)
    uninstall = " ".join(sorted({re.split(r"\s", f)[0] for f in found}))
    return (f"warning: also installed here: {names}; the two overwrite each other's '{COMMAND}' command or "
            f"'{PACKAGE}' files. Uninstall it (pip uninstall {uninstall}) or install dflash-mlx on its own "
            "(pipx install, or uv tool install; see the README)")
