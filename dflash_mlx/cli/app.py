"""``dflash``: the Typer app. Each command is thin wiring over the library;
:mod:`dflash_mlx.cli.main` runs it and turns flag errors into one line."""

from importlib import metadata

import typer

from .bench import bench
from .chat import chat
from .convert import convert
from .generate import generate
from .serve import serve
from .train import data, train

app = typer.Typer(
    name="dflash",
    help="DFlash speculative decoding on MLX: a block-diffusion drafter proposes a whole block of tokens, the "
    "target verifies it in one pass. Output is exactly the target's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps, never cuts text, reads well in a pipe
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {metadata.version('dflash-mlx')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version (dflash-mlx X.Y.Z) and exit."),
) -> None:
    """DFlash speculative decoding on MLX."""


# Short help is given, so the command list is never cut with "..." in a narrow terminal.
app.command(no_args_is_help=False, short_help="Generate from one prompt.")(generate)
app.command(short_help="Chat in the terminal.")(chat)
app.command(short_help="Regenerate training data with the target.")(data)
app.command(short_help="Train a drafter for a target.")(train)
app.command(context_settings={"allow_extra_args": True}, short_help="Benchmark against a baseline.")(bench)
app.command(short_help="Serve the pair over the OpenAI API.")(serve)
app.command(short_help="Convert a target and its drafter into one folder.")(convert)
