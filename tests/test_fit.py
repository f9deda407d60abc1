"""Every command's tables, progress bars and chat's /stats at 80 columns (dflash_mlx/cli/fit.py): on a
terminal and piped with COLUMNS=80 no line is wider, and every number stays whole; piped without COLUMNS,
rows stay whole for scripts."""

import copy
import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.text import Text

from dflash_mlx.bench.report import build_report
from dflash_mlx.chat.session import ChatSession
from dflash_mlx.cli.bench_tables import AGENT_DROP, CYCLE_DROP, RESULTS_DROP, agent_table, cycle_table, results_table
from dflash_mlx.cli.chat_ui import PlainView, RichView, summary_line
from dflash_mlx.cli.common import bars, print_table
from dflash_mlx.cli.convert import checks_table
from dflash_mlx.cli.train import eval_table
from dflash_mlx.pair.validation import Check
from dflash_mlx.stats import GenerationStats
from test_bench_report import synthetic

WIDTH = 80
NOT_SHOWN = re.compile(r"^not shown in 80 columns: (.+?) *$", re.M)


def bench_report() -> dict:
    """The synthetic run of test_bench_report on humaneval, against a draft-model baseline, at five variants."""
    report = build_report([synthetic()], {}, [])
    ds = report["datasets"][0]
    ds["name"], ds["baseline"]["engine"] = "humaneval", "draft-model"
    for b in (8, 16, "auto", "auto+tree"):
        ds["dflash"].append({**copy.deepcopy(ds["dflash"][0]), "block_size": b})
    return report


def agent_rows() -> list:
    return [dict(trace="agent_mbpp", mode=mode, requests=12, prompt_tokens=12345, reused=10000, prefilled=2345,
                 ttft_median_ms=123.4, ttft_total_s=1.234, total_s=12.34, ttft_vs_cold=0.456, total_vs_cold=0.789,
                 same_as_cold=mode != "cold" or None, tau_by_prompt_tokens={"0-512": 3.21, "512-2048": 3.4})
            for mode in ("cold", "disk", "live", "mlx-lm")]


def held_out() -> dict:
    """A drafter trained at B=16 and B=8: tau 1.03 (what split as ``1.0`` / ``3``), 15 positions."""
    return {16: {"tau": 1.0312, "tau_generation": 1.0291, "acceptance": [round(0.03 + i / 100, 2) for i in range(15)]},
            8: {"tau": 3.5, "acceptance": [round(0.9 - i / 10, 2) for i in range(7)]}}


def checks() -> list:
    return [Check("vocabulary", "target 151936, drafter 151936", True),
            Check("layers", "target 36, drafter reads [1, 9, 17, 25, 33]", True),
            Check("target vs unconverted", "32/32 tokens equal; quantized, may differ", None),
            Check("DFlash vs target", "32/32 tokens equal; tau 5.12 at block 16", True),
            Check("drafter logits", "max |diff| 0.0544 = 0.48% of max |logit| (8-bit, float32)", None)]


TABLES = {  # each command's tables: a builder and the columns that go first
    "bench results": (lambda: results_table(bench_report()), RESULTS_DROP),
    "bench cycle": (lambda: cycle_table(bench_report()), CYCLE_DROP),
    "bench agent": (lambda: agent_table(agent_rows()), AGENT_DROP),
    "train held-out": (lambda: eval_table(2000, held_out()), ()),
    "convert validation": (lambda: checks_table(checks()), ()),
}


def words(table) -> set:
    """The words of a table's title, headers and cells, as a person reads them."""
    return {w for cell in (table.title or "", *(c for column in table.columns for c in (column.header, *column.cells)))
            for w in Text.from_markup(cell).plain.split()}


def numbers_whole(shown: str, allowed: set) -> None:
    """Every word holding a digit is a whole word of a cell or header (``1.0`` then ``3`` is not)."""
    body = NOT_SHOWN.sub("", shown)
    split = [w for w in body.split() if re.search(r"\d", w) and w not in allowed]
    assert not split, f"numbers split: {split}\n{shown}"


def fits(shown: str) -> None:
    assert max(len(line) for line in shown.splitlines()) <= WIDTH, shown
    assert "…" not in shown, shown


def terminal() -> Console:
    return Console(file=io.StringIO(), width=WIDTH, force_terminal=True, color_system=None)


@pytest.mark.parametrize("where", ["terminal", "piped"])
@pytest.mark.parametrize("name", list(TABLES))
def test_every_table_fits_80_columns_and_keeps_numbers_whole(monkeypatch, name, where):
    build, drop = TABLES[name]
    allowed = words(build())
    if where == "terminal":
        console = terminal()
    else:
        monkeypatch.setenv("COLUMNS", str(WIDTH))
        console = Console(file=io.StringIO())
    print_table(build(), console, drop=drop)
    shown = console.file.getvalue()
    fits(shown)
    numbers_whole(shown, allowed)
    if where == "piped":
        assert "\x1b" not in shown and not set(shown) & set("─━│┃")
    gone = NOT_SHOWN.search(shown)
    gone = gone.group(1).split(", ") if gone else []
    assert not set(gone) & {"dataset", "engine", "tau", "B", "check", "result", "trace", "mode"}, gone


def test_drop_order_and_abbreviated_headers():
    console = terminal()
    print_table(results_table(bench_report()), console, drop=RESULTS_DROP)
    shown = console.file.getvalue()
    assert "ar" not in shown.split() and "(baseline)" in shown.split()  # the engine folds between words
    assert "outputs" in shown and "1/3" in shown  # what differs stays

    console = terminal()
    print_table(eval_table(2000, held_out()), console)
    shown = console.file.getvalue()
    assert "gen." in shown.split() and "generated" not in shown  # the header, not the numbers, gives way
    assert re.search(r"^16\s+1\.03\s+1\.03\s+0\.03\s+0\.04", shown, re.M), shown
    assert NOT_SHOWN.search(shown).group(1) == "14, 15"  # the last block positions go first


def test_piped_without_columns_keeps_rows_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = Console(file=io.StringIO(), width=WIDTH)
    print_table(eval_table(2000, held_out()), console)
    rows = console.file.getvalue().splitlines()
    assert rows[0] == "held-out acceptance at step 2000 (teacher forced)"
    assert re.fullmatch(r"16\s+1\.03\s+1\.03\s+" + r"\s+".join(f"{0.03 + i / 100:.2f}" for i in range(15)).replace(
        ".", r"\."), rows[2]), rows
    console = Console(file=io.StringIO(), width=WIDTH)
    print_table(checks_table(checks()), console)
    assert re.search(r"^drafter logits +max \|diff\| 0\.0544 = 0\.48% of max \|logit\| \(8-bit, float32\) +measured$",
                     console.file.getvalue(), re.M)


@pytest.mark.parametrize("force_terminal", [True, False])
@pytest.mark.parametrize("status", [True, False])
def test_progress_bars_keep_counts_whole(force_terminal, status):
    console = Console(file=io.StringIO(), width=WIDTH, force_terminal=force_terminal, color_system=None)
    progress = bars(console, status=status)
    fields = {"status": "loss 12.345 lr 6.00e-04 12,345 tok/s"} if status else {}
    progress.add_task("training" if status else "draft-model baseline on humaneval", total=2000, completed=77,
                      **fields)
    console.print(progress.make_tasks_table(progress.tasks))
    shown = console.file.getvalue()
    fits(shown)
    assert "77/2000" in shown.split() and "0:00:00" in shown and "-:--:--" in shown
    if status:
        assert all(w in shown.split() for w in fields["status"].split()), shown


def chat_lines() -> list:
    """/stats of a long session: a wide histogram, reused prompt tokens, offsets of two caches."""
    totals = GenerationStats(block_size=16, prompt_tokens=123456, prompt_reused=120000, generation_tokens=54321,
                             prompt_s=1.5, generation_s=9.87, peak_memory_gb=12.345)
    for accepted in range(16):
        for _ in range(100 + accepted):
            totals.record_step(accepted)
    cache = SimpleNamespace(drafter=object(), offsets=lambda: {"target": [177777], "drafter": [177776, 177777]},
                            is_consistent=lambda: True)
    session = SimpleNamespace(totals=totals, turns=12, interrupted=3, pair_cache=cache, tokens=[0] * 177777,
                              max_context=262144)
    return ChatSession.stats_lines(session) + [summary_line(totals, interrupted=True)]


def test_chat_stats_fit_a_terminal():
    view = RichView(color=False)
    view.console = terminal()
    lines = chat_lines()
    view.output(lines[:-1])
    view.summary(lines[-1])
    shown = view.console.file.getvalue()
    fits(shown)
    assert shown.split() == " ".join(lines).split()  # folded between words only


def test_chat_stats_piped(monkeypatch, capsys):
    lines = chat_lines()
    monkeypatch.delenv("COLUMNS", raising=False)
    PlainView().output(lines[:-1])
    PlainView().summary(lines[-1])
    out, err = capsys.readouterr()
    assert out.splitlines() == lines[:-1] and err.splitlines() == lines[-1:]  # whole, for scripts

    monkeypatch.setenv("COLUMNS", str(WIDTH))
    PlainView().output(lines[:-1])
    PlainView().summary(lines[-1])
    out, err = capsys.readouterr()
    fits(out + err)
    assert out.split() == " ".join(lines[:-1]).split() and err.split() == lines[-1].split()
