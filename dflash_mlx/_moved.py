"""Old flat module paths, kept importable for one release with a DeprecationWarning.

Until 0.2 the package was flat (``dflash_mlx.generate``, ``dflash_mlx.server``, ...). Each old path now
names the module at its new place: ``import dflash_mlx.generate`` warns once and gives the very module
``dflash_mlx.decode.generate`` (so a monkeypatch through either name reaches the same code). The aliases
are served by a finder at the end of ``sys.meta_path``, so a real module always wins and no file sits
at the old paths. Remove this file, and the ``install()`` in ``__init__``, in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

PACKAGE = "dflash_mlx"

# old module (under dflash_mlx) -> its new place
MOVED = {
    "acceptance": "decode.acceptance",
    "generate": "decode.generate",
    "stopping": "decode.stopping",
    "tree": "decode.tree",
    "verify": "decode.verify",
    "drafter_config": "drafter.config",
    "formats": "drafter.formats",
    "checkpoint": "drafter.checkpoint",
    "caches": "targets.caches",
    "loading": "pair.loading",
    "manifest": "pair.manifest",
    "convert": "pair.convert",
    "validation": "pair.validation",
    "server": "serve.app",
    "server_api": "serve.api",
    "server_engine": "serve.engine",
    "server_metrics": "serve.metrics",
    "session": "chat.session",
    "prompt_cache": "chat.prompt_cache",
    "simulate": "bench.simulate",
}
# ``dflash_mlx.drafter`` was the network module and is now a package: its old names are forwarded by
# the package's ``__getattr__`` (see ``forward``).
DRAFTER_MODULE = "drafter.network"


def _bootstrap(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def _ours(frame) -> bool:  # this file, or a package __getattr__ that forwards here
    return frame.f_code.co_filename == __file__ or frame.f_code.co_name == "__getattr__"


def _warn(old: str, new: str) -> None:
    """Warn at the first frame outside the import machinery and this file (the user's import line)."""
    level, frame = 2, sys._getframe(1)  # warnings counts frames past the import system's own
    while frame is not None and (_ours(frame) or _bootstrap(frame)):
        level += not _bootstrap(frame)
        frame = frame.f_back
    warnings.warn(f"{old} moved to {new}; the old path is removed in the next release", DeprecationWarning,
                  stacklevel=level)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None  # a throwaway module; exec_module swaps in the real one

    def exec_module(self, module) -> None:
        real = importlib.import_module(self.new)
        _warn(module.__name__, self.new)
        sys.modules[module.__name__] = real  # the import system returns what sys.modules holds


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != PACKAGE or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{PACKAGE}.{MOVED[name]}"))


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def forward(package: str, module: str, name: str, submodules) -> object:
    """A package ``__getattr__``: an old name of the module the package replaced, with a warning."""
    if name.startswith("__") or name in submodules:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    real = importlib.import_module(f"{PACKAGE}.{module}")
    if not hasattr(real, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{PACKAGE}.{module}.{name}")
    return getattr(real, name)
