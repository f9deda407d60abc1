"""Tables and lines made to fit a width: a terminal's, or ``COLUMNS`` in a pipe. Text folds at word
boundaries; a word (a number) is never split while its column can be kept."""

import io
import os
import textwrap
from typing import Iterable, List, Optional, Sequence, Tuple

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

WIDE = 10_000  # a width no table reaches: measures natural sizes
_MEASURE = Console(file=io.StringIO(), width=WIDE, color_system=None)  # measures only: never the real stdout


def columns() -> Optional[int]:
    """``COLUMNS`` from the environment when it is a positive integer, else None."""
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return width if width > 0 else None


def plain(renderables: Iterable[RenderableType], width: int) -> str:
    """``renderables`` as plain text at most ``width`` columns wide (strings: no markup, wrapped at word
    boundaries): no colour, no trailing spaces, each line ending in a newline."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, highlight=False,
                      emoji=False)
    for r in renderables:
        console.print(Text(r) if isinstance(r, str) else r)
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())


def piped(lines: Sequence[str]) -> str:
    """``lines`` for a pipe, each ending in a newline: as they are, or folded at word boundaries to fit
    ``COLUMNS`` when it is set."""
    width = columns()
    return "".join(f"{line}\n" for line in lines) if width is None else plain(lines, width)


def folded(lines: Sequence[str]) -> str:
    """``lines`` for stderr, each folded at word boundaries to its terminal's width (in a pipe, ``COLUMNS``;
    neither: as they are), the text after a line's ``Label: `` continuing under itself; words stay whole."""
    width = os.get_terminal_size(2).columns if os.isatty(2) else columns()
    return "\n".join(line if width is None else textwrap.fill(
        line, width, subsequent_indent=" " * (line.find(": ") + 2 if 0 < line.find(": ") < width // 3 else 0),
        break_long_words=False, break_on_hyphens=False) for line in lines)


def fit_table(table: Table, width: int, drop: Sequence[str] = ()) -> Table:
    """``table``, changed in place, drawn at most ``width`` columns wide; returns it.

    Every column stays at least as wide as its longest word, so numbers stay whole; text cells fold at word
    boundaries. Until the columns' longest words fit, in order: one space between columns instead of two; the
    columns whose header is in ``drop`` go (least important first); a header word wider than its column's cells
    is abbreviated (``generated`` -> ``gen.``); the last column goes. The first column always stays (folded if
    even it is too wide). A caption names the columns left out.
    """
    gone: List[Column] = []
    order = list(table.columns)
    while True:
        spans = [_span(c) for c in table.columns]
        spare = width - _cell_span(table)[1] + sum(hi - lo for lo, hi in spans)  # left, cells folded to longest words
        if spare >= 0 or len(table.columns) == 1:
            break
        if _tighten(table):
            continue
        named = next((c for name in drop for c in table.columns if c.header == name), None)
        if named is None and _abbreviate(table):
            continue
        gone.append(_remove(table, named or table.columns[-1]))
    for column, w in zip(table.columns, _widths(spans, spare)):
        column.width, column.overflow = w, "fold"
    if gone:
        names = (" ".join(str(c.header).split()) for c in sorted(gone, key=order.index))
        table.caption = f"not shown in {width} columns: " + ", ".join(names)
        table.caption_justify = "left"
    return table


def _cell_span(renderable) -> Tuple[int, int]:
    m = Measurement.get(_MEASURE, _MEASURE.options, renderable)
    return m.minimum, m.maximum


def _span(column: Column, header: bool = True) -> Tuple[int, int]:
    """(longest word, longest line) of the column's cells, and of its header unless ``header`` is False."""
    spans = [_cell_span(c) for c in ([column.header] if header else []) + list(column.cells)] or [(0, 0)]
    return max(lo for lo, _ in spans), max(hi for _, hi in spans)


def _widths(spans, spare: int) -> List[Optional[int]]:
    """None each (natural widths) when all lines fit; else each column's longest word, and the ``spare``
    columns to the columns that lack least for their longest line first (the fewest cells fold)."""
    if spare >= sum(hi - lo for lo, hi in spans) or spare < 0:
        return [None] * len(spans)
    widths = [lo for lo, _ in spans]
    for i in sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0]):
        give = min(spare, spans[i][1] - spans[i][0])
        widths[i], spare = widths[i] + give, spare - give
    return widths


def _tighten(table: Table) -> bool:
    """One space between columns: padding collapsed (no box), or none (a box draws its divider). False when
    already so."""
    if table.box is None and not table.collapse_padding:
        table.collapse_padding = True
        return True
    if table.box is not None and any(table.padding):
        table.padding = (0, 0)
        return True
    return False


def _abbreviate(table: Table) -> bool:
    """Shorten the header words of the column where that saves most, to its cells' longest word (at least 4
    characters, the last a dot). False when no header is wider than its cells."""
    best, saving, header = None, 0, None
    for column in table.columns:
        if not isinstance(column.header, str):
            continue
        cells = max(_span(column, header=False)[0], 4)
        short = "\n".join(" ".join(w if len(w) <= cells else w[:cells - 1] + "." for w in line.split(" "))
                          for line in column.header.split("\n"))
        gain = _span(column)[0] - max(_cell_span(short)[0], _span(column, header=False)[0])
        if gain > saving:
            best, saving, header = column, gain, short
    if best is not None:
        best.header = header
    return best is not None


def _remove(table: Table, column: Column) -> Column:
    """Take ``column`` out of ``table``; returns it."""
    table.columns.remove(column)
    for i, c in enumerate(table.columns):
        c._index = i  # Rich pads the first and last column by their index
    return column
