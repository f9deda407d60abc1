"""`dflash chat` end to end on stories260K with a random drafter: driven through a real
pty (pexpect), and scripted through a pipe (plain text, no ANSI codes)."""

import io
import json
import os
import re
import shutil
import sys

import pexpect
import pytest

from conftest import dflash, needs_shared

STORY = ", there was a little girl named Lily."
CACHE = re.compile(r"Cache: (\d+) tokens of \d+ \(target (\d+), drafter (\d+)\)")


def chat_args(model, drafter, *args):
    return ["chat", "--model", str(model), "--draft-model", str(drafter), *args]


def check_cache_line(text):
    """The last ``Cache:`` line: target and drafter offsets equal the conversation's."""
    n, target, drafter = map(int, CACHE.findall(text)[-1])
    assert n == target == drafter, text
    return n


@pytest.fixture(scope="module")
def long_stories(stories, tmp_path_factory):
    """stories260K with a context of a million tokens: a reply under a large /max
    cannot end by filling the context before a Ctrl-C lands (at 512, it could)."""
    folder = tmp_path_factory.mktemp("long") / "stories260K"
    shutil.copytree(stories, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1_000_000
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@needs_shared
def test_a_session_in_an_80_column_terminal_fits_it(stories):
    """The header, a reply's summary, /stats and /help in an 80-column terminal: no line wider."""
    from conftest import ROOT

    drafter = ROOT / "examples" / "stories260K" / "drafter"
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", *chat_args(stories, drafter, "-m", "30")]
    child = pexpect.spawn(cmd[0], cmd[1:], encoding="utf-8", dimensions=(40, 80), timeout=90,
                          env={**os.environ, "TERM": "xterm-256color"})
    log = io.StringIO()
    child.logfile_read = log
    child.expect_exact(">>> ")
    for line in ("Once upon a time", "/stats", "/help", "/quit"):
        child.sendline(line)
        child.expect_exact(">>> " if line != "/quit" else pexpect.EOF)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]|\x1b\][^\x07]*\x07", "", log.getvalue())  # colours, cursor moves
    lines = re.split(r"\r?\n|\r", text)
    assert "dflash chat" in text and any("tau" in line for line in lines) and "/block" in text
    assert not [line for line in lines if len(line) > 80], text


@needs_shared
def test_driven_session_in_a_pty(long_stories, random_drafter):
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", *chat_args(long_stories, random_drafter, "--max-tokens", "30")]
    child = pexpect.spawn(cmd[0], cmd[1:], encoding="utf-8", dimensions=(50, 120), timeout=60,
                          env={**os.environ, "TERM": "xterm-256color"})
    log = io.StringIO()
    child.logfile_read = log

    def prompt():
        child.expect_exact(">>> ")

    try:
        child.expect_exact("dflash chat")  # the header panel
        prompt()
        for turn in ("Once upon a time", "The next day"):
            child.sendline(turn)
            child.expect(r"30 tokens · [\d.]+ tok/s · tau 1\.00 · [\d.]+ GB peak")
            prompt()
        child.sendline("/stats")
        child.expect(CACHE)
        assert int(child.match.group(1)) > 60 and check_cache_line(child.match.group(0))
        prompt()

        # Ctrl-C while a long reply streams (the live status line shows it is running).
        # The reply cannot end first: its greedy text has no EOS within reach, and
        # 100000 tokens take minutes here.
        child.sendline("/max 100000")
        prompt()
        child.sendline("Lily")
        child.expect(r"accept \d+\.\d%")
        child.send("\x03")
        child.expect(r"stopped: both caches rolled back to (\d+) tokens")
        rolled = int(child.match.group(1))
        prompt()
        child.sendline("/stats")
        child.expect(r"Turns: 3 \(1 interrupted\)")
        child.expect(CACHE)
        assert check_cache_line(child.match.group(0)) == rolled
        prompt()

        # The session goes on after the interrupt, then /reset empties both caches.
        child.sendline("/max 20")
        prompt()
        child.sendline("The end")
        child.expect(r"20 tokens · ")
        prompt()
        child.sendline("/reset")
        child.expect("history and caches cleared")
        prompt()
        child.sendline("/stats")
        child.expect(CACHE)
        assert check_cache_line(child.match.group(0)) == 0
        prompt()
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    out = log.getvalue()
    assert child.exitstatus == 0, out
    assert "Traceback" not in out and "INCONSISTENT" not in out
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert "little girl named Lily" in plain


@needs_shared
def test_piped_turns_plain_text(stories, random_drafter, tmp_path):
    lines = [
        "Once upon a time", "The next day", "/stats", "/block 4", "/think on", "/temp nope", "/nope",
        f"/save {tmp_path / 'chat.md'}",
        "/reset", "Once upon a time. " * 120,  # more than the context: refused
        "/max 1000", "Once upon a time. " * 96,  # fills the context to the brim
        "And then", "/reset", "/max 30", "Once upon a time", "/stats",
    ]
    r = dflash(*chat_args(stories, random_drafter, "-m", "30"), input="\n".join(lines) + "\n", text=True)
    assert r.returncode == 1, r.stderr  # three lines failed; the others still ran
    assert "\x1b" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert r.stdout.startswith(STORY) and r.stdout.count(STORY) >= 2
    assert check_cache_line(r.stdout) == 5 + 30 - 1  # BOS + "Once upon a time" + reply - last
    assert len(re.findall(r"^30 tokens · .* GB peak", r.stderr, re.M)) == 3
    for needle in ("block size 4", "error: usage: /temp T", "error: unknown command /nope",
                   "error: the conversation is 601 tokens", "the context (512 tokens) is full",
                   "no chat template"):
        assert needle in r.stderr, needle
    assert "## User\n\nOnce upon a time" in (tmp_path / "chat.md").read_text()


def test_help_lists_the_flags():
    r = dflash("chat", "--help", text=True)
    assert r.returncode == 0
    for flag in ("--model", "--draft-model", "--max-tokens", "--temp", "--top-p", "--top-k",
                 "--block-size", "--seed", "--system-prompt", "--chat-template-config", "--no-color"):
        assert flag in r.stdout


@pytest.mark.parametrize("color", [True, False])
def test_rich_view_marks_drafted_and_thinking(color):
    from rich.console import Console

    from dflash_mlx import GenerationStats
    from dflash_mlx.cli.chat_ui import RichView
    from dflash_mlx.chat.session import ChatEvent, Piece

    view = RichView(color=color)
    buf = io.StringIO()
    view.console = Console(file=buf, force_terminal=True, color_system="standard", width=60)
    stats = GenerationStats(block_size=4)
    events = [
        ChatEvent([Piece("<think>plan", thinking=True), Piece("ned</think>", True, True)], [], 1, None, stats),
        ChatEvent([Piece("Hello", drafted=True), Piece(" world\nbye")], [], 1, "stop", stats),
    ]
    last, interrupted = view.stream(iter(events))
    out = buf.getvalue()
    assert last is events[-1] and not interrupted
    assert "\x1b[2m<think>plan" in out  # thinking is dimmed, with or without colour
    assert ("\x1b[2;36mned</think>" in out and "\x1b[36mHello" in out) == color
    assert ("\x1b[36m" in out) == color
    assert re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).count("Hello world") == 1


@needs_shared
def test_piped_commands_name_themselves_and_reset_clears_the_totals(stories, random_drafter):
    lines = ["Once upon a time", "/block 1", "/temp -1", "/max 0", "/reset", "/stats"]
    r = dflash(*chat_args(stories, random_drafter, "-m", "10"), input="\n".join(lines) + "\n", text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: /block 1 is out of range: this drafter supports 2..8 (tokens a verify holds: the last one and "
                      "up to 7 drafts)",
                      "error: /temp must be >= 0, got -1.0", "error: /max must be at least 1, got 0"]
    assert "--" not in "".join(errors)
    assert "Turns: 0 (0 interrupted)" in r.stdout and "Generation: 0 tokens" in r.stdout
    assert "Acceptance: no turns yet" in r.stdout and "from prefill" not in r.stdout
    # Without a failed line, a piped session exits 0.
    r = dflash(*chat_args(stories, random_drafter, "-m", "10"), input="Once upon a time\n/stats\n", text=True)
    assert r.returncode == 0, r.stderr


@needs_shared
def test_stats_before_any_turn_says_there_are_none(stories, random_drafter):
    r = dflash(*chat_args(stories, random_drafter), input="/stats\n", text=True)
    assert r.returncode == 0, r.stderr
    assert "Turns: 0 (0 interrupted)" in r.stdout and "Acceptance: no turns yet" in r.stdout, r.stdout
    assert "from prefill" not in r.stdout and "Histogram" not in r.stdout


def test_summary_line_counts_in_the_singular_for_one():
    from dflash_mlx import GenerationStats
    from dflash_mlx.cli.chat_ui import summary_line

    one = summary_line(GenerationStats(block_size=4, prompt_tokens=45, prompt_reused=44, generation_tokens=1))
    assert one.startswith("1 token · ") and one.endswith("prefill 1 token, 44 reused"), one
    two = summary_line(GenerationStats(block_size=4, prompt_tokens=2, generation_tokens=2))
    assert two.startswith("2 tokens · ") and two.endswith("prefill 2 tokens, 0 reused"), two


@pytest.mark.parametrize("on", [True, False])
def test_color_command_prints_one_line(on):
    from rich.console import Console

    from dflash_mlx.cli.chat_ui import RichView

    view = RichView(color=not on)
    buf = io.StringIO()
    view.console = Console(file=buf, width=200)
    view.set_color(on)
    assert view.color == on and buf.getvalue().count("\n") == 1
    assert ("colour off" in buf.getvalue()) == (not on)


def test_header_says_the_drafters_quantization_too(stories, random_drafter):
    """The header's quantization row names the target's and the drafter's (an 8-bit drafter beside a float
    target is not 'none')."""
    from types import SimpleNamespace

    import mlx.nn as nn

    from dflash_mlx import load
    from dflash_mlx.cli.chat import header_rows

    pair = load(str(stories), str(random_drafter))
    o = SimpleNamespace(block_size=None, temp=0.0, max_tokens=10)
    session = SimpleNamespace(use_template=False, max_context=None, thinking=None)
    assert dict(header_rows(pair, session, o))["quantization"] == "none (float32) · drafter none (float32)"
    nn.quantize(pair.drafter, group_size=64, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    assert dict(header_rows(pair, session, o))["quantization"] == "none (float32) · drafter 8-bit (group 64)"
