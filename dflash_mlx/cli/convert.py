"""``dflash convert``: a target and its drafter into one folder (:func:`dflash_mlx.pair.convert.convert`)."""

import sys
import time
from contextlib import redirect_stdout
from typing import Annotated, Optional

from typer import Option

from .common import check_out_folder, fail, guard, print_table
from .fit import folded


def convert(
    model: Annotated[str, Option("--model", help=(
        "Target: a repo id, a local folder (Hugging Face or mlx-lm) or a .gguf file (Ollama, LM Studio)."))],
    out: Annotated[str, Option("--out", "-o", help=(
        "Output folder: target/, drafter/ and dflash.json; without --draft-model, an mlx-lm model folder."))],
    draft_model: Annotated[Optional[str], Option("--draft-model", help=(
        "Its DFlash drafter: a repo id or a local folder. Omit it to convert the target alone."))] = None,
    quantize: Annotated[bool, Option("--quantize", "-q", help="Quantize the target with mlx-lm.")] = False,
    q_bits: Annotated[Optional[int], Option("--q-bits", help=(
        "Target bits per weight: 4 or 8 (default 4); for a GGUF file, the bits of the tensors not carried "
        "over as they are (Q2_K, Q3_K, I-quants), quantized again (Q6_K at 8)."))] = None,
    q_group_size: Annotated[Optional[int], Option("--q-group-size", help="32, 64 or 128 (default 64).")] = None,
    q_mode: Annotated[str, Option("--q-mode", help="affine, mxfp4, nvfp4 or mxfp8.")] = "affine",
    draft_q_bits: Annotated[Optional[int], Option("--draft-q-bits", help="Drafter bits: 4 or 8.")] = None,
    draft_q_group_size: Annotated[int, Option("--draft-q-group-size", help="32, 64 or 128.")] = 64,
    dtype: Annotated[Optional[str], Option("--dtype", help=(
        "float16, bfloat16 or float32 for the float weights (default: as stored); dequantizes a GGUF file."))] = None,
    force: Annotated[bool, Option("--force", help="Replace an existing output folder.")] = False,
    validate: Annotated[bool, Option("--validate/--no-validate", help="Check the result (short greedy runs).")] = True,
) -> None:
    """Convert a target and its drafter into one folder that `dflash generate|chat|bench --model DIR` runs,
    or a target alone (a Hugging Face folder or a GGUF file) into an mlx-lm folder.

    OUT appears only once complete: a failure, Ctrl-C or SIGTERM leaves nothing. A pair's validation table
    follows. A GGUF file (llama incl. Llama 3.1+, qwen2, qwen3, phi3, gemma3; any type the gguf package reads)
    stays quantized unless --dtype is given: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K as stored, others again at --q-bits.

    \b
    Examples:
      dflash convert --model Qwen/Qwen3-4B --draft-model z-lab/Qwen3-4B-DFlash-b16 --out qwen3-4b-dflash -q
      dflash convert --model ./Qwen3-8B --draft-model ./Qwen3-8B-DFlash-b16 --out q8 -q --q-bits 8 --draft-q-bits 8
      dflash convert --model SmolLM2-135M-Instruct.Q4_1.gguf --out smol --dtype float32
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

    from dflash_mlx.errors import ValidationError
    from dflash_mlx.pair.convert import check_options, convert as convert_pair
    from dflash_mlx.pair.gguf import is_gguf

    check_options(kwargs["quantize"] or is_gguf(kwargs["model"]), *(kwargs[k] for k in ("q_bits", "q_group_size", "q_mode", "draft_q_bits",
                                        "draft_q_group_size", "dtype")))  # flags first, then the folders
    check_out_folder(kwargs["out"])
    stages = _Stages(Console(stderr=True))
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
    if kwargs["draft_model"] is not None:
        return print(folded([f"wrote {result.out}: target/, drafter/, dflash.json.",
                             f"Run: dflash chat --model {result.out}"]), file=sys.stderr)
    target = result.manifest["target"]
    quant = target["quantization"]
    kept = f"{quant['bits']}-bit (group {quant['group_size']})" if quant else target["dtype"]
    lines = [f"wrote {result.out}: an mlx-lm {target['model_type']} model, {kept}.",
             f"Run: dflash generate --model {result.out} -p \"Hello\""]
    if "gguf_types" in target:
        again = f"; {target['requantized']} quantized again by MLX" if target["requantized"] else ""
        lines.insert(0, f"Read: {', '.join(f'{n} {k}' for k, n in target['gguf_types'].items())}{again}; "
                        f"{target['bits_per_weight']} bits per weight")
    print(folded(lines), file=sys.stderr)


class _Stages:
    """One line per stage on stderr, with a spinner while it runs (not while fetching: the hub draws bars)."""

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
    for name, justify in (("check", "left"), ("result", "left"), ("", "center")):
        table.add_column(name, justify=justify)
    marks = {True: "[green]ok[/green]", False: "[red]FAIL[/red]", None: "[dim]measured[/dim]"}
    for check in checks:
        table.add_row(check.name, check.result, marks[check.ok])
    return table
