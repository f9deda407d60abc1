"""``dflash``: the entry point, and its guards for Ctrl-C, closed or failing standard streams and other installed
``dflash`` commands. Exit codes: 0 success, 1 error (one line on stderr, bad flags included), 130 interrupted
(Ctrl-C, at any moment: imports run inside :func:`main`), 141 output pipe closed."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Iterable, List, Optional

from dflash_mlx.errors import DFlashError

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on stderr


def main(args: Optional[List[str]] = None) -> None:
    """Run ``dflash`` with ``args`` (default: ``sys.argv[1:]``) and exit with its code."""
    try:
        keep_interrupts()
        from dflash_mlx.atomic import signals_held
        with signals_held():  # a Ctrl-C inside nanobind's start of the extension is lost, an ImportError or an abort
            import mlx.core  # noqa: F401
        protect()  # closed stdin/stdout: /dev/null on the descriptor, a named error on use
        if line := warning(conflicts()):
            print(line, file=sys.stderr)
        code = _run(args)
    except KeyboardInterrupt:  # before the app runs (typer turns later ones into Exit(130))
        code = 130
    sys.exit(code)


def keep_interrupts() -> None:
    """A Ctrl-C that lands in a finalizer (which cannot raise) is delivered again to the main thread."""
    import _thread
    import time
    default = sys.unraisablehook

    def deliver(returned: list) -> None:  # once the hook has returned: a Ctrl-C while it runs is lost
        while not returned:
            time.sleep(0.001)
        time.sleep(0.005)
        _thread.interrupt_main()

    def hook(unraisable) -> None:  # never blocks (threading's start waits for the thread: a load stretched that)
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _thread.start_new_thread(deliver, (returned := [],))
            returned.append(1)
        else:
            default(unraisable)

    sys.unraisablehook = hook


def _run(args: Optional[List[str]]) -> int:
    import typer

    try:
        from typer._click import exceptions as cx  # recent typer ships its own click
    except ImportError:
        from click import exceptions as cx

    from .app import app

    try:
        code = typer.main.get_command(app).main(args=args, prog_name="dflash", standalone_mode=False)
    except getattr(cx, "NoArgsIsHelpError", ()) as e:  # `dflash` alone: the help
        print(e.ctx.get_help())
        return 0
    except cx.UsageError as e:  # a bad flag or value: one line naming it, as for other bad input
        hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        print(f"error: {_usage_message(e)}{hint}", file=sys.stderr)
        return 1
    except typer.Abort:
        return 130
    except (cx.ClickException, DFlashError) as e:  # DFlashError: outside a command's guard (stdout closed in --help)
        message = e.format_message() if isinstance(e, cx.ClickException) else str(e)
        print(f"error: {_one_line(message)}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0


def _one_line(message: str) -> str:
    text = " ".join(message.split()).rstrip(".")
    return text[:1].lower() + text[1:]


def _usage_message(e: Exception) -> str:
    """click's message on one line; a value typer could not convert is quoted."""
    text = e.format_message()
    errors = getattr(e.__cause__, "errors", None)  # typer validates values with pydantic
    if callable(errors):
        first = errors()[0]
        detail = first["msg"].split(",")[0]  # "Input should be a valid integer"
        text = text.replace(first["msg"], f"{detail[:1].lower()}{detail[1:]}, got {first['input']!r}")
    return _one_line(text)


OUR_ENTRY_POINT = "dflash_mlx.cli.main:main"
PACKAGE = "dflash_mlx"
COMMAND = "dflash"


def _provides_package(dist: md.Distribution) -> bool:
    if (top := dist.read_text("top_level.txt")) is not None:
        return PACKAGE in top.split()
    record = dist.read_text("RECORD")  # read as text: dist.files makes a path of each of its lines
    if record is not None:
        return any(line.lstrip('"').startswith(PACKAGE + "/") for line in record.splitlines())
    return any(str(f).split("/")[0] == PACKAGE for f in (dist.files or []))


def conflicts(dists: Optional[Iterable[md.Distribution]] = None) -> List[str]:
    """One description per clashing distribution (name, version, what it provides, where); ours (whose
    ``dflash`` is :data:`OUR_ENTRY_POINT`, an editable install maybe listed twice) are skipped."""
    import importlib.metadata as md

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
    uninstall = " ".join(sorted({f.split()[0] for f in found}))
    return (f"warning: also installed here: {names}; the two overwrite each other's '{COMMAND}' command or "
            f"'{PACKAGE}' files. Uninstall it (pip uninstall {uninstall}) or install dflash-mlx on its own "
            "(pipx install, or uv tool install; see the README)")


NAMES = {0: ("stdin", "standard input", "<&-"), 1: ("stdout", "standard output", ">&-")}


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
            from .common import silence_stdout

            silence_stdout()
            raise StreamError(f"cannot write to standard output ({e.strerror or e})") from None

    def write(self, text: str) -> int:
        return self._checked("write", text)

    def flush(self) -> None:
        self._checked("flush")


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
            new = os.open(os.devnull, os.O_RDWR)  # so no file opened later takes the number
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
            closed.append(fd)
    for fd in closed:
        if fd == 2:  # errors must still go somewhere: to /dev/null, quietly
            sys.stderr = open(os.devnull, "w")
        else:
            setattr(sys, NAMES[fd][0], ClosedStream(fd))
    if 1 not in closed and sys.stdout is not None and not isinstance(sys.stdout, CheckedStdout):
        sys.stdout = CheckedStdout(sys.stdout)
    return closed


if __name__ == "__main__":
    main()
