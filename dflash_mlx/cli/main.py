"""``dflash``: the entry point. Exit codes: 0 success, 1 error (one line on stderr, bad flags included),
130 interrupted (Ctrl-C, at any moment: imports run inside :func:`main`), 141 output pipe closed."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on stderr


def main(args: Optional[List[str]] = None) -> None:
    """Run ``dflash`` with ``args`` (default: ``sys.argv[1:]``) and exit with its code."""
    try:
        keep_interrupts()
        from .conflicts import conflicts, warning
        from .stdio import protect

        protect()  # closed stdin/stdout: /dev/null on the descriptor, a named error on use
        line = warning(conflicts())
        if line:
            print(line, file=sys.stderr)
        code = _run(args)
    except KeyboardInterrupt:  # before the app runs (typer turns later ones into Exit(130))
        code = 130
    sys.exit(code)


def keep_interrupts() -> None:
    """A Ctrl-C that lands in a finalizer (which cannot raise) is delivered again to the main thread."""
    import _thread
    import threading

    default = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            timer = threading.Timer(0.01, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
        else:
            default(unraisable)

    sys.unraisablehook = hook


def _run(args: Optional[List[str]]) -> int:
    import typer

    try:
        from typer._click import exceptions as cx  # recent typer ships its own click
    except ImportError:
        from click import exceptions as cx

    from dflash_mlx.errors import DFlashError

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
    except cx.ClickException as e:
        print(f"error: {_one_line(e.format_message())}", file=sys.stderr)
        return 1
    except typer.Abort:
        return 130
    except DFlashError as e:  # outside a command's guard (a closed stdout while printing help)
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
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


if __name__ == "__main__":
    main()
