"""Standard streams the shell closed (``<&-``) or that cannot be written (``> /dev/full``): one line naming
the stream. A closed descriptor gets ``/dev/null``, so no file opened later takes its number."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, List

from dflash_mlx.errors import DFlashError

NAMES = {0: ("stdin", "standard input", "<&-"), 1: ("stdout", "standard output", ">&-"),
         2: ("stderr", "standard error", "2>&-")}


class StreamError(DFlashError):
    """A standard stream is closed or cannot be written (the message says which)."""


class ClosedStream:
    """Stands for a stream the shell closed: any use raises :class:`StreamError`."""

    def __init__(self, fd: int):
        _, name, shell = NAMES[fd]
        hint = ": pass the prompt with --prompt TEXT" if fd == 0 else ""
        self._message = f"{name} is closed ({shell}){hint}"

    def __getattr__(self, name: str) -> Any:
        raise StreamError(self._message)

    def flush(self) -> None:  # the interpreter flushes at exit: nothing was written
        pass


class CheckedStdout:
    """``sys.stdout`` whose failed writes raise :class:`StreamError` (a closed pipe: ``BrokenPipeError``)."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _checked(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            silence_stdout()
            raise StreamError(f"cannot write to standard output ({e.strerror or e})") from None

    def write(self, text: str) -> int:
        return self._checked("write", text)

    def flush(self) -> None:
        self._checked("flush")


def silence_stdout() -> None:
    """Point descriptor 1 at /dev/null, so what is still buffered does not fail again at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError:
        pass


def protect() -> List[int]:
    """/dev/null on each closed standard descriptor, a :class:`ClosedStream` in its ``sys`` slot, a working
    stdout wrapped in :class:`CheckedStdout`. Returns the descriptors that were closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError as e:
            if e.errno != errno.EBADF:
                continue
            new = os.open(os.devnull, os.O_RDWR)
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
            closed.append(fd)
    for fd in closed:
        attr = NAMES[fd][0]
        if fd == 2:  # errors must still go somewhere: to /dev/null, quietly
            sys.stderr = open(os.devnull, "w")
        else:
            setattr(sys, attr, ClosedStream(fd))
    if 1 not in closed and sys.stdout is not None and not isinstance(sys.stdout, CheckedStdout):
        sys.stdout = CheckedStdout(sys.stdout)
    return closed
