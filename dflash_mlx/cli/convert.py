"""``dflash convert``: a target and its drafter into one folder; wiring over
:func:`dflash_mlx.pair.convert.convert`."""

from __future__ import annotations

import sys
import time
from contextlib import redirect_stdout
from typing import Optional

import typer

from .common import fail, guard


def convert(
    model: str = typer.Option(..., "--model", help="Target: a Hugging Face repo id or a local folder "
                              "(Hugging Face or mlx-lm format)."),
    draft_model: str = typer.Option(..., "--draft-model", help="Its DFlash drafter: a repo id or a local folder."),
    out: str = typer.Option(..., "--out", "-o", help="Output folder: target/, drafter/ and dflash.json."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the target with mlx-lm."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Target bits per weight: 4 or 8 (default 4)."),
    q_group_size: Optional[int] = typer.Option(None, "--q-group-size", help="Target group size: 32, 64 or 128 (default 64)."),
    q_mode: str = typer.Option("affine", "--q-mode", help="Target quantization mode: affine, mxfp4, nvfp4 or mxfp8."),
    draft_q_bits: Optional[int] = typer.Option(
        None, "--draft-q-bits",
        help="Quantize the drafter to 4 or 8 bits (default: keep it float). fc, hidden_norm and the "
        "norms stay float; it computes in float32.",
    ),
    draft_q_group_size: int = typer.Option(64, "--draft-q-group-size", help="Drafter group size: 32, 64 or 128."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float16, bfloat16 or float32 for the float weights (default: the target's torch_dtype; "
        "the drafter as stored).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder (once the new one is complete)."),
    validate: bool = typer.Option(
        True, "--validate/--no-validate",
        help="Check the result against the sources (short greedy runs; needs memory for the larger of the "
        "unconverted and converted targets).",
    ),
) -> None:
    """Convert a target and its drafter into one folder that `dflash generate|chat|bench --model DIR` runs.

    The target goes through mlx-lm's convert (an mlx-lm folder is copied unless asked otherwise), the drafter through dflash's loader. Writes go to a temporary folder beside OUT, renamed into place at the end: a failure, Ctrl-C or SIGTERM leaves nothing, and what a killed run left is removed at the next start. A short validation table follows.

    \b
    Examples:
      dflash convert --model Qwen/Qwen3-4B --draft-model z-lab/Qwen3-4B-DFlash-b16 --out qwen3-4b-dflash -q
      dflash convert --model ./Qwen3-8B --draft-model ./Qwen3-8B-DFlash-b16 --out q8 -q --q-bits 8 --draft-q-bits 8
      dflash chat --model qwen3-4b-dflash
    """
    args = dict(locals())
    try:
        guard(lambda: _run(**args))
    except KeyboardInterrupt as e:
        from dflash_mlx.atomic import Terminated

        if isinstance(e, Terminated):  # SIGTERM: 128 + 15, as a shell reports it
            fail(f"terminated; nothing was written to {out}", code=143)
        fail(f"interrupted; nothing was written to {out}", code=130)


def _run(validate, **kwargs) -> None:
    from rich.console import Console

    from dflash_mlx import ValidationError
    from dflash_mlx.pair.convert import check_options, convert as convert_pair

    from .common import check_out_folder
    from .render import print_table

    check_options(*(kwargs[k] for k in ("quantize", "q_bits", "q_group_size", "q_mode", "draft_q_bits",
                                        "draft_q_group_size", "dtype")))  # flags first, then the folders
    check_out_folder(kwargs["out"])
    console = Console(stderr=True)
    stages = _Stages(console)
    try:
        with redirect_stdout(sys.stderr):  # mlx-lm's [INFO] lines; stdout gets only the table
            result = convert_pair(validate_output=validate, progress=stages, **kwargs)
    except ValidationError as e:
        stages.close()
        print_table(checks_table(e.checks))
        raise
    finally:
        stages.close()
    if result.checks:
        print_table(checks_table(result.checks))
    console.print(f"wrote {result.out}: target/, drafter/, dflash.json. Run: dflash chat --model {result.out}",
                  soft_wrap=True)


class _Stages:
    """One line per stage on stderr, with a spinner while it runs (none while
    huggingface_hub downloads, which draws its own progress bars)."""

    def __init__(self, console):
        self.console, self.status, self.start = console, None, time.perf_counter()

    def __call__(self, stage: str) -> None:
        self.close()
        self.console.print(f"[dim]{time.perf_counter() - self.start:6.1f}s[/dim] {stage}")
        if not stage.startswith("fetching"):
            self.status = self.console.status(stage)
            self.status.start()

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def checks_table(checks):
    """The validation checks as a Rich table: check, result, ok / FAIL / measured."""
    from rich.table import Table

    table = Table(title="validation", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("", justify="center")
    marks = {True: "[green]ok[/green]", False: "[red]FAIL[/red]", None: "[dim]measured[/dim]"}
    for check in checks:
        table.add_row(check.name, check.result, marks[check.ok])
    return table
