"""Writes that leave nothing half-done, whatever signal arrives: :func:`staging` (a whole folder renamed
into place) and :func:`atomic_file` (one file). Any failure leaves as one :class:`WriteError`; temporary
names carry the writer's process id, so a later run can remove a dead writer's leftovers."""

import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator, List, Optional

from .errors import InputError


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import, before any thread could race with it
_FILE_MODE = 0o666 & ~_UMASK  # a new file's mode under the process's umask


def stderr_warning(message: str) -> None:
    """One ``warning: MESSAGE`` line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class WriteError(OSError):
    """A write that failed: an ``OSError`` of any errno, or MLX's ``RuntimeError`` (errno EIO); ``filename``
    names the path."""


def write_error(e: BaseException, path: Path) -> WriteError:
    """``e`` (raised while writing ``path``) as a :class:`WriteError`."""
    if isinstance(e, WriteError):
        return e
    code = getattr(e, "errno", None) or errno.EIO
    reason = getattr(e, "strerror", None) or " ".join(str(e).split()) or type(e).__name__
    return WriteError(code, reason, str(getattr(e, "filename", None) or path))


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised like Ctrl-C so the same cleanup runs (exit 143)."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Terminated` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Signals with a Python handler (Ctrl-C, :class:`Terminated`) held in the block, handled at its end: for MLX's C++
    calls into Python code, which lose an exception or make it another (``mx.savez``'s zipfile). Main thread only."""
    main, held = threading.current_thread() is threading.main_thread(), []
    handlers = {s: h for s in signums if callable(h := signal.getsignal(s))} if main else {}
    for s in handlers:
        signal.signal(s, lambda signum, _: held.append(signum))
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            handlers[s](s, None)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def remove_stale(out: Path, say: Callable[[str], None] = lambda _: None) -> List[Path]:
    """Clean up after a run killed while writing ``out``: ``.OUT.tmp-*`` of writers that are gone are
    removed, a ``.OUT.old-PID`` (the previous ``out``) restored when ``out`` is missing, else removed.
    Returns the paths removed or restored."""
    done = []
    for kind in ("tmp", "old"):
        for p in sorted(out.parent.glob(f".{out.name}.{kind}-*")):
            writer = re.search(re.escape(f".{kind}-") + r"(\d+)", p.name)  # the writer's process id
            if writer is not None and pid_alive(int(writer.group(1))):
                continue
            if kind == "old" and not out.exists():
                p.rename(out)
                say(f"restored {out} from {p}, moved aside by an interrupted run")
            else:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                say(f"removed {p}, left by an interrupted run")
            done.append(p)
    return done


def check_out(out: Path, force: bool, flag: str = "--out") -> None:
    """Refuse an existing output folder unless ``force``, and a file always (``InputError`` naming ``flag``)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out} is a file; give a folder path")
    if out.exists() and not force:
        raise InputError(f"{flag} {out} already exists; pass --force to replace it")


@contextmanager
def staging(out: Path, force: bool = False, flag: str = "--out",
            say: Callable[[str], None] = lambda _: None) -> Iterator[Path]:
    """A temporary folder beside ``out`` that replaces it when the block succeeds; on any exception (Ctrl-C and SIGTERM
    included) it and any parent folder made here are removed, ``out`` left as it was. Raises InputError: ``out``
    appeared meanwhile and ``force`` is off (names ``flag``); WriteError: a write or the rename failed; Terminated:
    SIGTERM arrived."""
    remove_stale(out, say)
    created = next((p for p in reversed([out.parent, *out.parent.parents]) if not p.exists()), None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_as_interrupt():
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        try:
            tmp.chmod(0o777 & ~_UMASK)  # mkdtemp makes it private; the output should not be
            yield tmp
            _replace(tmp, out, force, flag)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            if isinstance(e, OSError):
                raise write_error(e, out) from e
            raise


def _replace(tmp: Path, out: Path, force: bool, flag: str) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and deleted last."""
    if not out.exists():
        tmp.rename(out)
        return
    check_out(out, force, flag)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(path: Path, parents: bool = False) -> Iterator[Path]:
    """A temporary path beside ``path`` (``.NAME.tmp-PID.SUFFIX``) to write to, renamed over ``path`` when the block
    succeeds (mode as ``open()`` under the umask), removed when it fails; ``parents``: create the missing folders first.
    Raises WriteError: the folder, the write or the rename failed; nothing is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.chmod(tmp, _FILE_MODE)  # as open() would make it: some writers (safetensors) make theirs 0600
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        unlink_file(tmp)
        raise write_error(e, path) from e
    except BaseException:
        unlink_file(tmp)
        raise


def write_json(path: Path, value, indent: Optional[int] = None, parents: bool = False, **dumps) -> None:
    """``value`` as JSON and a newline at ``path``, whole or not at all (:func:`atomic_file`; raises WriteError)."""
    with atomic_file(path, parents) as tmp:
        tmp.write_text(json.dumps(value, indent=indent, **dumps) + "\n")


def unlink_file(path: Path) -> None:
    """Remove ``path`` when it is a file; anything else (a folder by that name), or a refused removal (a
    read-only folder), is left."""
    with suppress(OSError):
        if path.is_file():
            path.unlink()
