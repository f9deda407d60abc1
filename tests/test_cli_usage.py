"""The `dflash` entry point: flag errors, help, exit codes, Ctrl-C and closed pipes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_shared
from dflash_mlx.cli.main import main

COMMANDS = ["generate", "chat", "data", "train", "bench", "serve"]


def run_main(capsys, *args):
    """``dflash ARGS`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def dflash(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli.main", *args], **kwargs)


@pytest.mark.parametrize("args, flag", [
    (["generate", "--block-size", "abc"], "--block-size"),
    (["generate", "--temp", "hot"], "--temp"),
    (["generate", "--nope"], "--nope"),
    (["chat", "--top-k", "1.5"], "--top-k"),
    (["chat", "--max-tokens"], "--max-tokens"),
    (["data", "--model", "m", "--out", "o", "--max-tokens", "many"], "--max-tokens"),
    (["train", "--model", "m", "--data", "d", "--out", "o", "--steps", "1.5"], "--steps"),
    (["train", "--data", "d", "--out", "o"], "--model"),
    (["bench", "-n", "x"], "--num-samples"),
    (["nope"], "nope"),
])
def test_flag_errors_are_one_line_and_exit_1(capsys, args, flag):
    code, out, err = run_main(capsys, *args)
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err, err
    assert "╭" not in err and "Usage:" not in err


def test_bad_value_is_quoted(capsys):
    _, _, err = run_main(capsys, "generate", "--block-size", "abc")
    assert "'abc'" in err and "integer" in err and "dflash generate --help" in err


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags_everywhere(capsys, command, flag):
    code, out, err = run_main(capsys, *command, flag)
    assert code == 0 and err == ""
    assert out.startswith("Usage: dflash") and "-h, --help" in out


def test_no_arguments_print_the_help(capsys):
    code, out, _ = run_main(capsys)
    assert code == 0 and "Commands:" in out and all(c in out for c in COMMANDS)


@pytest.mark.parametrize("columns", ["50", "80"])
@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_help_is_wrapped_never_cut(capsys, monkeypatch, command, columns):
    """80 columns is what a pipe gets; 50 a narrow terminal."""
    monkeypatch.setenv("COLUMNS", columns)
    _, out, _ = run_main(capsys, *command, "--help")
    lines = out.splitlines()[1:]  # past "Usage: dflash [OPTIONS] COMMAND [ARGS]..."
    assert "…" not in out and not any(line.endswith("...") for line in lines), out
    if command and command[0] in ("generate", "chat", "bench") and columns == "80":
        assert "z-lab/Qwen3-4B-DFlash-b16" in out  # the default pair, in full


def test_help_agrees_with_the_flags(capsys):
    _, out, _ = run_main(capsys, "bench", "--help")
    assert "0 for all" in " ".join(out.split())
    _, out, _ = run_main(capsys, "generate", "--help")
    assert "vocabulary size and above, is off" in " ".join(out.split())


def test_negative_num_samples_is_refused_with_the_rule(capsys, tmp_path):
    code, _, err = run_main(capsys, "bench", "--draft-model", "d", "-n", "-1", "--out", str(tmp_path / "o"))
    assert code == 1 and "--num-samples must be 0 (all samples) or more" in err


@needs_shared
def test_closed_output_pipe_exits_141_quietly(stories):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte, as with `| head -c 0`
    p = dflash("generate", "--model", str(stories), "-p", "Once upon a time", "-m", "40",
               stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141, err
    assert err == ""


def loading_mlx(pid: int) -> None:
    """Return as soon as process ``pid`` has MLX's library mapped (``import mlx.core`` under way), polling
    /proc every millisecond; where /proc is missing, 0.3 s after the start."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        time.sleep(0.3)
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if "libmlx" in maps.read_text():
                return
        except OSError:  # gone: the caller's checks say why
            return
        time.sleep(0.001)


@needs_shared
@pytest.mark.parametrize("moment", ["loading mlx", "generating"])
def test_ctrl_c_at_any_time_exits_130_without_a_traceback(stories, moment):
    """Whether the signal lands as MLX's extension loads (12 runs, signalled 0 to 5.5 ms after libmlx is mapped:
    before the CLI held Ctrl-C over ``import mlx.core``, such a signal was lost, became an ImportError or aborted
    the process), or while generating (its first text is out, 400 tokens asked). The process is still running
    when the signal is sent, and ends by it: a run that finished, or a lost signal, fails."""
    for delay in range(12 if moment == "loading mlx" else 1):
        p = dflash("generate", "--model", str(stories), "-p", "Once upon a time", "-m", "400",
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        head = ""
        if moment == "generating":
            head = p.stdout.read(1)  # the text streams: this returns with its first character
        else:
            loading_mlx(p.pid)
            time.sleep(delay / 2000)  # the extension's initialisation follows the mapping by a few ms
        assert p.poll() is None, p.communicate()[1]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        out = head + out
        # 130: interrupted; -SIGINT: the signal came before Python set up its own handler, so the process died of
        # it, quietly (a loaded machine).
        assert p.returncode in (130, -signal.SIGINT), err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err
        assert "Generation: 400 tokens" not in err  # stopped by the signal, not finished
        assert out == "" or out.endswith("\n")


def test_an_interrupt_inside_a_finalizer_is_delivered_again_quietly():
    """A Ctrl-C raised inside a ``__del__`` (where the 1.5 s case above once landed, in the
    regex module during imports) reaches the main thread as a KeyboardInterrupt, with no
    "Exception ignored" traceback; without the hook it is printed and lost."""
    code = """
import sys, time
from dflash_mlx.cli.main import keep_interrupts
if sys.argv[1] == "hook":
    keep_interrupts()
class Dies:
    def __del__(self):
        raise KeyboardInterrupt
try:
    Dies()
    for _ in range(200):
        time.sleep(0.005)
    print("lost")
except KeyboardInterrupt:
    print("interrupted")
"""
    for mode, want in (("hook", "interrupted"), ("none", "lost")):
        p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
        assert p.stdout.strip() == want, (mode, p.stdout, p.stderr)
        assert ("Exception ignored" in p.stderr) == (mode == "none"), p.stderr


@needs_shared
def test_interrupted_generate_ends_its_line(stories, capsys, monkeypatch):
    import dflash_mlx.decode.generate as generate_module
    from dflash_mlx.decode.generate import stream_generate

    def interrupted(*args, **kwargs):
        for i, r in enumerate(stream_generate(*args, **kwargs)):
            if i == 3:
                raise KeyboardInterrupt
            yield r

    monkeypatch.setattr(generate_module, "stream_generate", interrupted)
    code, out, err = run_main(capsys, "generate", "--model", str(stories), "-p", "Once upon a time", "-m", "50")
    assert code == 130 and err == ""
    assert out.startswith(", there was") and out.endswith("\n") and not out.endswith("\n\n")


@needs_shared
def test_interactive_prefill_step_is_small(stories, capsys, monkeypatch):
    """Ctrl-C is seen between prefill chunks: generate and chat use 128-token chunks
    on a CPU and 512 on a GPU (mlx-lm's 2048 take seconds), and the flag sets them."""
    import mlx.core as mx

    import dflash_mlx.decode.generate as generate_module
    from dflash_mlx.decode.generate import stream_generate

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["prefill_step_size"])
        yield from stream_generate(*args, **kwargs)

    monkeypatch.setattr(generate_module, "stream_generate", spy)
    base = ["generate", "--model", str(stories), "-p", "Once", "-m", "2", "--quiet"]
    assert run_main(capsys, *base)[0] == 0
    assert run_main(capsys, *base, "--prefill-step-size", "64")[0] == 0
    assert seen == [512 if mx.default_device() == mx.gpu else 128, 64]
    code, _, err = run_main(capsys, *base, "--prefill-step-size", "0")
    assert code == 1 and "--prefill-step-size" in err


@pytest.mark.parametrize("args", [
    ["generate", "--model", "m", "-p", "x", "--temp", "-1"],
    ["generate", "--model", "m", "-p", "x", "--block-size", "4"],
    ["generate", "--model", "m", "-p", "x", "--prompt-cache-gb", "0"],
    ["chat", "--model", "m", "-m", "0"],
    ["serve", "--model", "m", "--max-batch", "0"],
    ["bench", "--model", "m", "--draft-model", "d", "--temp", "-1"],
    ["data", "--model", "m", "--out", "o"],
])
def test_a_bad_flag_is_reported_before_mlx_lm_is_imported(args, tmp_path):
    """Flags are checked before the 2-3 s of importing mlx-lm and transformers: a fresh
    process that fails on a flag has not imported them (no clock read)."""
    code = ("import sys\nfrom dflash_mlx.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'mlx_lm' in sys.modules, 'transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.stdout.strip() == "exit 1 False False", (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
