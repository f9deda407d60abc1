"""``dflash``: the Typer app. Each command is thin wiring over the library."""

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on stderr

import typer  # noqa: E402

from .chat import chat  # noqa: E402
from .generate import generate  # noqa: E402
from .train import data, train  # noqa: E402
from .bench import bench  # noqa: E402
from .serve import serve  # noqa: E402
from .convert import convert  # noqa: E402

app = typer.Typer(
    name="dflash",
    help=(
        "DFlash speculative decoding on MLX: a block-diffusion drafter proposes a whole "
        "block of tokens, the target verifies it in one pass. Output is exactly the "
        "target's own."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """DFlash speculative decoding on MLX."""


app.command(no_args_is_help=False)(generate)
app.command()(chat)
app.command()(data)
app.command()(train)
app.command(context_settings={"allow_extra_args": True})(bench)
app.command()(serve)
app.command()(convert)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
