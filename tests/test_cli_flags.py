"""Every flag of every command is checked before any work: a bad value is one line
naming the flag and exit 1, never a traceback and never a silent run. The property test
drives each numeric flag the commands declare (read from the Typer app, so a new flag is
covered) with generated values; --version; --draft-model without --model; hints that
name commands which exist; bench without matplotlib or a dataset.

The CLI runs in-process through :func:`dflash_mlx.cli.main.main`; --model points at a
missing folder, so a value that passes its check ends the run with a one-line error too."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from conftest import needs_shared
from dflash_mlx.cli.app import app
from dflash_mlx.cli.main import main


def run(*args: str):
    """``dflash ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def one_line_error(result, *needles) -> str:
    code, out, err = result
    assert "Traceback" not in out + err, err
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture(autouse=True)
def no_conflicts_scan(monkeypatch):
    """Skip the scan of every installed distribution at each start (tests/test_conflicts.py
    covers it): it would be most of each in-process run's time here."""
    monkeypatch.setattr("dflash_mlx.cli.main.conflicts", lambda: [])


@pytest.fixture(scope="module")
def missing(tmp_path_factory) -> Path:
    """A scratch folder; its ``model`` and ``drafter`` do not exist."""
    return tmp_path_factory.mktemp("flags")


def base_args(command: str, root: Path) -> list:
    """Arguments with which a run that passes its flag checks stops cheaply: the model
    (and data) folders are missing, no prompt cache is opened."""
    model, drafter = root / "model", root / "drafter"
    (root / "a-file").touch()
    pair = ["--model", model, "--draft-model", drafter]
    return {
        "generate": [*pair, "-p", "Once", "--no-prompt-cache"],
        "chat": [*pair, "--no-prompt-cache"],
        "serve": [*pair, "--no-prompt-cache"],
        "bench": [*pair, "--no-plots", "--out", root / "bench", "--dataset", root / "missing.jsonl"],
        "data": ["--model", model, "--out", root / "data", "--prompts", root / "missing.jsonl"],
        "train": ["--model", model, "--data", root / "no-data", "--out", root / "train"],
        "convert": [*pair, "--out", root / "a-file" / "converted"],  # its stages print lines: stop before
    }[command]


def numeric_flags():
    """(command, flag) for every int or float option of every command of the app."""
    import typer

    for name, command in sorted(typer.main.get_command(app).commands.items()):
        for param in command.params:
            if param.param_type_name == "option" and param.type_descriptor.annotation in (int, float):
                yield pytest.param(name, param.opts[0], id=f"{name} {param.opts[0]}")


FLAGS = list(numeric_flags())
VALUES = st.one_of(st.sampled_from(["-inf", "1e308", "0.5", "99"]), st.integers().map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))


def test_every_command_has_numeric_flags():
    commands = {p.values[0] for p in FLAGS}
    assert commands == {"generate", "chat", "data", "train", "bench", "serve", "convert"}
    assert len(FLAGS) > 50


@pytest.mark.parametrize("command,flag", FLAGS)
@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(value="0")
@example(value="-1")
@example(value="nan")
@example(value="inf")
@example(value=str(10**30))
@given(value=VALUES)
def test_a_numeric_flag_is_checked_before_any_work(missing, command, flag, value):
    code, out, err = run(command, *base_args(command, missing), flag, value)
    assert "Traceback" not in out + err, err
    assert code == 0 or (code == 1 and err.startswith("error: ") and err.count("\n") == 1), (code, err)


# The cases a new user met: each was a traceback or a silent run.
@pytest.mark.parametrize("command,args,message", [
    ("train", ["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
    ("train", ["--anchors", "0"], "--anchors must be at least 1, got 0"),
    ("train", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("train", ["--lr", "-1"], "--lr must be > 0, got -1.0"),
    ("train", ["--steps", "-3"], "--steps must be at least 1, got -3"),
    ("train", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("train", ["--warmup", "nan"], "--warmup must be a finite number, got nan"),
    ("train", ["--block-size", "0"], "--block-size must be at least 2, got 0"),
    ("data", ["--shard-size", "0"], "--shard-size must be at least 1, got 0"),
    ("data", ["--temp", "-1"], "--temp must be >= 0, got -1.0"),
    ("data", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ("generate", ["--temp", "inf"], "--temp must be a finite number, got inf"),
    ("generate", ["--block-size", "1"],
     "--block-size must be at least 2 (or 'auto'), got 1 (see dflash generate --help)"),
    ("serve", ["--prompt-cache-gb", "inf"], "--prompt-cache-gb must be a finite number, got inf"),
    ("bench", ["--block-size", "16", "--simulate-acceptance", "99"],
     "--simulate-acceptance must be in 0..15 (a block of 16 holds 15 drafts), got 99"),
    ("bench", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
])
def test_known_bad_values_are_one_line(missing, command, args, message):
    err = one_line_error(run(command, *base_args(command, missing), *args))
    assert err == f"error: {message}\n"


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_sharding_in_one_process_is_refused(missing, command, sharding):
    """--sharding splits the target over mlx.launch's ranks: in one process it would be ignored."""
    err = one_line_error(run(command, *base_args(command, missing), "--sharding", sharding))
    assert err.startswith("error: --sharding ") and "mlx.launch" in err and "leave it out" in err, err
    err = one_line_error(run(command, *base_args(command, missing)))
    assert "--sharding" not in err, err  # without the flag: the missing model, as before


def test_version():
    from importlib.metadata import version

    code, out, err = run("--version")
    assert (code, out, err) == (0, f"dflash-mlx {version('dflash-mlx')}\n", "")
    assert out == "dflash-mlx 0.1.0\n"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_a_drafter_without_a_target_is_refused(missing, command):
    args = ["-p", "Once"] if command == "generate" else []
    one_line_error(run(command, "--draft-model", missing / "drafter", *args), "--draft-model needs --model")


def test_the_offline_hint_names_a_command_that_exists(monkeypatch):
    from dflash_mlx import CheckpointError
    from dflash_mlx.hub import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as e:
        resolve_model_path("no-such-owner-x/no-such-model-y", ["*.json"])
    assert "`hf download no-such-owner-x/no-such-model-y --local-dir DIR`" in str(e.value)
    assert (Path(sys.executable).parent / "hf").exists()  # installed with huggingface_hub


def test_bench_names_the_dataset_it_cannot_have(missing, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed (a quick-start install)
    args = [a for a in base_args("bench", missing)][:-2]
    one_line_error(run("bench", *args, "--dataset", "gsm8k", "-n", "0"), "--dataset gsm8k:", "pip install datasets",
                   "--dataset PATH")


@needs_shared
def test_a_dataset_that_cannot_be_had_leaves_no_results_folder(stories, random_drafter, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    out = tmp_path / "results"
    one_line_error(run("bench", "--model", stories, "--draft-model", random_drafter, "--dataset", "gsm8k",
                       "-n", "0", "--no-plots", "--out", out), "--dataset gsm8k:")
    assert not out.exists()


@needs_shared
def test_bench_without_matplotlib_skips_the_plots_and_warns_only_when_asked(stories, random_drafter, tmp_path,
                                                                             monkeypatch):
    """Without matplotlib (no 'plot' extra) the default draws no plots and says nothing; --plots warns once,
    naming the package pip installs (not the 'dflash-mlx' name on PyPI, another project's)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    for flags, warned in (([], []), (["--plots"], ["warning: matplotlib is not installed: no plots are drawn "
                                                   "(pip install matplotlib, or pass --no-plots)"])):
        out = tmp_path / f"out{len(flags)}"
        code, stdout, err = run("bench", "--model", stories, "--draft-model", random_drafter, "--dataset", prompts,
                                "-n", "1", "-m", "4", "--warmup-tokens", "0", "--out", out, *flags)
        assert code == 0 and "Traceback" not in err, err
        assert [line for line in err.splitlines() if line.startswith("warning:")] == warned
        assert (out / "results.json").is_file() and not list(out.glob("*.png"))


@needs_shared
def test_simulated_acceptance_past_the_trained_block_is_refused(stories, random_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    r = run("bench", "--model", stories, "--draft-model", random_drafter, "--dataset", prompts, "-n", "1", "-m", "4",
            "--no-plots", "--out", tmp_path / "out", "--simulate-acceptance", "99")  # trained block size 8
    one_line_error(r, "--simulate-acceptance must be in 0..7 (a block of 8 holds 7 drafts), got 99")
