"""Output a person reads: tables that fit the terminal, plain text in pipes and logs,
a spinner while a model loads.

Every Rich table of the CLI is printed through :func:`print_table`.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Iterator, Optional

from rich import box
from rich.console import Console
from rich.table import Table

PLAIN_WIDTH = 10_000  # wide enough that no row of a plain table is folded


def print_table(table: Table, console: Optional[Console] = None) -> None:
    """Print ``table`` on ``console`` (default: stdout).

    On a terminal the table fits its width (:func:`fitted`). Elsewhere (a pipe, a
    file, a log) it is plain text: no box drawing, no colour, every row on one line,
    columns two spaces apart, no trailing spaces, and a last newline, so whatever is
    printed next starts on its own line.
    """
    console = console or Console()
    if console.is_terminal:
        console.print(fitted(table, console.width))
        return
    title, table.title = table.title, None  # on a line of its own, whole
    table.box, table.show_edge, table.pad_edge = None, False, False
    width = Console(width=PLAIN_WIDTH).measure(table).maximum
    text = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, highlight=False,
                   emoji=False)
    if title:
        text.print(title, soft_wrap=True, markup=False)
    text.print(table)
    console.file.write("".join(line.rstrip() + "\n" for line in text.file.getvalue().splitlines()))
    console.file.flush()


def fitted(table: Table, width: int) -> Table:
    """``table`` made to fit ``width`` terminal columns: a light box without edges,
    padding shared between neighbours, and cells (headers too) that fold onto the next
    line where a column must narrow, never cut to ``…``."""
    table.box, table.show_edge, table.pad_edge, table.collapse_padding = box.SIMPLE_HEAD, False, False, True
    for column in table.columns:
        column.overflow, column.no_wrap = "fold", False
    return table


@contextmanager
def spinner(text: str) -> Iterator[None]:
    """A spinner with ``text`` on stderr while the body runs, only when stderr is a
    terminal (a pipe or a log gets nothing)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with console.status(text):
        yield
