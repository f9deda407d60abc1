"""The commands in README.md and docs/*.md as written: every `dflash SUBCOMMAND` names a subcommand that
exists, every flag it passes is one that subcommand takes (from its --help), and every file of this
repository it points at (examples/, scripts/, benchmarks/) is there. The commands themselves need models
and data the tests do not have; what drifts most, names, is checked here."""

import os
import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT, dflash

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&"}


def commands():
    """``(doc, subcommand, argv)`` of every `dflash ...` line in the docs' shell blocks (continuations joined,
    comments and what follows a shell operator dropped)."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                m = re.search(r"(?:^|\s|/)dflash ([a-z][\w-]*)(.*)", line.strip())
                if not m or line.strip().startswith("#"):
                    continue
                argv = []
                for token in shlex.split(m.group(2), comments=True):
                    if token in SHELL or re.match(r"\d?>", token):  # a pipe, a list or a redirection
                        break
                    argv.append(token)
                found.append((doc.relative_to(ROOT), m.group(1), argv))
    return found


COMMANDS = commands()


def test_the_docs_hold_commands_of_every_subcommand():
    assert {sub for _, sub, _ in COMMANDS} >= {"generate", "chat", "serve", "convert", "bench", "data", "train"}


@pytest.mark.parametrize("sub", sorted({sub for _, sub, _ in COMMANDS}))
def test_every_flag_in_the_docs_is_one_the_command_takes(sub):
    r = dflash(sub, "--help", text=True, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, f"`dflash {sub}` in the docs is not a command: {r.stderr}"
    taken = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", r.stdout))
    for doc, s, argv in COMMANDS:
        if s != sub:
            continue
        for token in argv:
            flag = token.split("=", 1)[0]
            if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag):
                assert flag in taken, f"{doc}: `dflash {sub} ... {flag}`: not a flag of dflash {sub}"


def test_every_repository_file_the_docs_run_is_there():
    for doc, sub, argv in COMMANDS:
        for token in argv:
            if re.match(r"(examples|scripts|benchmarks)/", token):
                assert (ROOT / token).exists(), f"{doc}: `dflash {sub}` points at {token}, which is not there"


# What a reader has after the README's quick start (models/stories260K converted, the repository's examples/),
# plus the random drafter docs/chat.md's capture names; a command needing anything else is skipped, saying what.
SANDBOX = ("models/stories260K", "models/random-drafter", "examples/")
INPUTS = ("--model", "--draft-model", "--data", "--prompts", "--init", "--dataset", "--agent-trace")


def needs(sub, argv):
    """Why a docs command cannot run in the sandbox (the hub, a server, a file the docs have the reader make),
    or None."""
    if sub == "serve":
        return "a server (tests/test_server*.py run it)"
    if any(not t.isprintable() or t.startswith("\u2500") for t in argv) or "--model" not in argv:
        return "the Hugging Face hub (the default model) or not a command line"
    for flag, value in zip(argv, argv[1:]):
        if flag in INPUTS and not value.startswith(SANDBOX):
            return f"{value} (the Hugging Face hub or a file the reader makes)"
    return None


RUNNABLE = [(doc, sub, argv) for doc, sub, argv in COMMANDS if needs(sub, argv) is None]


def test_the_docs_quick_start_commands_are_among_those_run():
    assert {sub for _, sub, _ in RUNNABLE} >= {"generate", "chat"} and len(RUNNABLE) >= 5


@pytest.mark.parametrize("doc, sub, argv", RUNNABLE, ids=[f"{d}:{s}:{i}" for i, (d, s, _) in enumerate(RUNNABLE)])
def test_every_runnable_docs_command_runs_as_written(doc, sub, argv, stories, random_drafter, tmp_path):
    """Each command of the docs that needs no hub, server or file of the reader's own runs as written (chat with
    its input at an end), from a folder laid out as after the README's quick start: exit 0, no traceback."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "stories260K").symlink_to(stories)
    (tmp_path / "models" / "random-drafter").symlink_to(random_drafter)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    r = dflash(sub, *argv, cwd=tmp_path, text=True, timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"{doc}: `dflash {sub} {' '.join(argv)}`: {r.stderr}"


def test_every_script_imports_names_the_package_has():
    """Each `from dflash_mlx... import NAME` in benchmarks/ and scripts/ (the scripts the docs run) names a module
    and an attribute that exist: a name moved or removed in the package breaks them, not a user's run later."""
    import ast
    import importlib

    missing = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dflash_mlx":
                try:
                    module = importlib.import_module(node.module)
                except ModuleNotFoundError:
                    missing.append(f"{path.relative_to(ROOT)}: {node.module}")
                    continue
                missing += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not (hasattr(module, "__path__") and
                                                                    importlib.util.find_spec(f"{node.module}.{a.name}"))]
    assert not missing, "\n".join(missing)
