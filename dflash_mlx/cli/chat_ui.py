"""Views of ``dflash chat`` over :class:`dflash_mlx.chat.session.ChatEvent` streams: rich (a terminal) or plain."""

import sys
import time
from contextlib import contextmanager, suppress
from typing import Iterable, Iterator, List, Optional, Tuple

from rich.box import ROUNDED
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from dflash_mlx.chat.session import ChatEvent, Piece
from dflash_mlx.stats import plural

from .fit import piped

DRAFTED = "cyan"  # tokens the target accepted from the drafter
PROMPT = ">>> "


def summary_line(stats, interrupted: bool = False) -> str:
    """``N tokens · X tok/s · tau Y · Z GB peak · prefill P tokens, R reused`` (no tau without a drafter)."""
    head = "interrupted · " if interrupted else ""
    tau = stats.tau_text()
    return (f"{head}{plural(stats.generation_tokens, 'token')} · {stats.generation_tps:.1f} tok/s · "
            + (f"{tau} · " if tau else "") + f"{stats.peak_memory_gb:.3f} GB peak · "
            f"prefill {plural(stats.prompt_prefilled, 'token')}, {stats.prompt_reused} reused")


class PlainView:
    """Not a terminal: a turn per input line, replies on stdout, summaries and notices on stderr, no ANSI."""

    color = False
    interactive = False

    def header(self, rows: List[Tuple[str, str]]) -> None:
        pass

    def set_color(self, on: bool) -> None:
        self.notice("colour: not a terminal, the output stays plain text")

    def read(self) -> str:
        """One line, bytes that are not UTF-8 kept as surrogate escapes."""
        line = sys.stdin.buffer.readline()
        if not line:
            raise EOFError
        return line.decode("utf-8", "surrogateescape").rstrip("\n")

    def stream(self, events: Iterable[ChatEvent]) -> Tuple[Optional[ChatEvent], bool]:
        """Write a reply as it comes; returns ``(last event, interrupted)``."""
        last = None
        try:
            for ev in events:
                sys.stdout.write("".join(p.text for p in ev.pieces))
                sys.stdout.flush()
                last = ev
            return last, False
        except KeyboardInterrupt:
            return last, True
        finally:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def notice(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def summary(self, text: str) -> None:
        sys.stderr.write(piped([text]))
        sys.stderr.flush()

    def error(self, text: str) -> None:
        print(f"error: {text}", file=sys.stderr, flush=True)

    def output(self, lines: List[str]) -> None:
        sys.stdout.write(piped(lines))
        sys.stdout.flush()


@contextmanager
def no_echo() -> Iterator[None]:
    """Keys typed during a reply (``^C`` too) are not echoed over it; they stay buffered for the prompt."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except Exception:  # no termios, no file descriptor, or not a terminal
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class _Reply:
    """The live part of one reply: the unfinished line and the status line."""

    def __init__(self, console: Console, style):
        self.console, self.style = console, style
        self.line = Text()
        self.shown = Text()  # a copy the refresh thread may read
        self.numbers = None
        self.t0 = time.perf_counter()

    def add(self, ev: ChatEvent) -> None:
        for p in ev.pieces:
            self.line.append(p.text, style=self.style(p))
        if "\n" in self.line.plain:
            *done, self.line = self.line.split("\n", allow_blank=True)
            for part in done:
                self.console.print(part)
        width = self.console.width - 1
        if self.line.cell_len > width:
            *done, last = self.line.wrap(self.console, width)
            for part in done:
                self.console.print(part)
            self.line = last
        s = ev.stats
        accept = None if s.acceptance_rate is None else f"accept {100 * s.acceptance_rate:.1f}%"
        self.numbers = (s.generation_tokens, " · ".join(x for x in (s.tau_text(), accept) if x), s.generation_tps)
        self.shown = self.line.copy()

    def __rich__(self):
        elapsed = time.perf_counter() - self.t0
        if self.numbers is None:
            status = f"prefill · {elapsed:.1f} s"
        else:
            n, spec, tps = self.numbers
            spec = f"{spec} · " if spec else ""
            status = f"{plural(n, 'token')} · {spec}{tps:.1f} tok/s · {elapsed:.1f} s"
        return Group(self.shown, Text("  ⋯ " + status, style="dim"))


class RichView:
    """A terminal: header panel, line editing (readline), colours, live status."""

    interactive = True

    def __init__(self, color: bool = True):
        self.color = color
        self.console = Console(highlight=False)
        with suppress(ImportError):
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach chat as escapes
            sys.stdin.reconfigure(errors="surrogateescape")

    def style(self, piece: Piece) -> str:
        parts = [DRAFTED] if piece.drafted and self.color else []
        if piece.thinking:
            parts.append("dim")
        return " ".join(parts)

    def header(self, rows: List[Tuple[str, str]]) -> None:
        w = max(len(k) for k, _ in rows)
        body = "\n".join(f"[bold]{k.ljust(w)}[/bold]  {escape(v)}" for k, v in rows)
        self.console.print(Panel(body, title="dflash chat", title_align="left", box=ROUNDED,
                                 border_style="blue" if self.color else "", padding=(0, 1)))
        self.console.print(self.legend())
        self.console.print("  /help for commands · Ctrl-C stops a reply · Ctrl-D or /quit exits", style="dim")

    def legend(self) -> Text:
        if self.color:
            return Text.assemble("  ", ("drafted", DRAFTED), " tokens were accepted from the drafter, "
                                 "the rest are the target's own · ", ("thinking is dimmed", "dim"))
        return Text.assemble("  colour off (/color on marks drafted tokens) · ", ("thinking is dimmed", "dim"))

    def set_color(self, on: bool) -> None:
        self.color = on
        self.console.print(self.legend())

    def read(self) -> str:
        prompt = f"\001\x1b[1;32m\002{PROMPT}\001\x1b[0m\002" if self.color else PROMPT
        return input(prompt)

    def stream(self, events: Iterable[ChatEvent]) -> Tuple[Optional[ChatEvent], bool]:
        """Render a reply live; returns ``(last event, interrupted)``."""
        reply, last, interrupted = _Reply(self.console, self.style), None, False
        try:
            with no_echo(), Live(reply, console=self.console, transient=True, refresh_per_second=10,
                                 redirect_stdout=False, redirect_stderr=False) as live:
                tick = 0.0
                for ev in events:
                    reply.add(ev)
                    last = ev
                    if time.perf_counter() - tick > 0.05:
                        live.refresh()
                        tick = time.perf_counter()
        except KeyboardInterrupt:
            interrupted = True
        if reply.line.plain:
            self.console.print(reply.line)
        return last, interrupted

    def summary(self, text: str) -> None:
        self.console.print(Padding(Text(text, style="dim"), (0, 0, 0, 2), expand=False))

    def notice(self, text: str) -> None:
        self.console.print("  " + text, style="yellow" if self.color else "", markup=False)

    def error(self, text: str) -> None:
        self.console.print(f"  error: {text}", style="bold red" if self.color else "bold", markup=False)

    def output(self, lines: List[str]) -> None:
        for line in lines:  # folded at word boundaries, under the indent
            self.console.print(Padding(Text(line), (0, 0, 0, 2), expand=False))
