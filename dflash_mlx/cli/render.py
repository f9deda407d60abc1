"""Tables that fit the terminal (plain text in pipes and logs), progress bars and a spinner."""

from __future__ import annotations

import io
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator, Optional

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

PLAIN_WIDTH = 10_000  # wide enough that no row of a plain table is folded


def print_table(table: Table, console: Optional[Console] = None) -> None:
    """Print ``table`` on ``console`` (default: stdout): fitted to a terminal, else plain text (a row per line,
    no box, colour or trailing spaces)."""
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
    """``table`` made to fit ``width`` columns: a light box, cells folded, never cut to ``…``."""
    table.box, table.show_edge, table.pad_edge, table.collapse_padding = box.SIMPLE_HEAD, False, False, True
    for column in table.columns:
        column.overflow, column.no_wrap = "fold", False
    return table


def spinner(text: str) -> ContextManager:
    """A spinner with ``text`` on stderr while the body runs, only when stderr is a terminal."""
    console = Console(stderr=True)
    return console.status(text) if console.is_terminal else nullcontext()


def bars(console: Console, *extra) -> Progress:
    """Progress bars on ``console``: name, bar, done/total, the ``extra`` columns, elapsed time and ETA."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra, TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console)


@contextmanager
def progress_bars(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """Yields ``progress(name, done, total)``: a bar per name on ``console``, shown from the first call."""
    bar, tasks = bars(console), {}

    def progress(name: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        bar.update(tasks[name], completed=done)

    try:
        yield progress
    finally:
        if tasks:
            bar.stop()
