"""Flags, prompt reading and error reporting shared by the commands."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

import typer

from dflash_mlx.errors import DFlashError, InputError
from dflash_mlx.hub import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from dflash_mlx.ranges import check_number

MODEL_HELP = (
    "Target model: a local mlx-lm folder or a Hugging Face repo id (downloaded into "
    f"the HF cache). Default with neither flag: {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL}. "
    "A folder written by `dflash convert` gives both target and drafter."
)
DRAFT_HELP = (
    "DFlash drafter: a local folder or repo id in the released format. Without it, "
    "the same engine decodes plainly (for comparison)."
)


# Flags shared by generate and chat (and bench): one definition, the same help text.
def model_option():
    return typer.Option(None, "--model", help=MODEL_HELP)


def draft_model_option():
    return typer.Option(None, "--draft-model", help=DRAFT_HELP)


def verify_option():
    return typer.Option(
        False, "--verify", help="Check a `dflash convert` folder's weight files against the sha256 in its dflash.json first."
    )


def temp_option():
    return typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")


def top_p_option():
    return typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1].")


def top_k_option():
    return typer.Option(
        0, "--top-k", help="Sample from the k most likely tokens; 0, or the vocabulary size and above, is off."
    )


def min_p_option():
    return typer.Option(0.0, "--min-p", help="Min-p threshold, in [0, 1]; 0 is off.")


def sharding_option():
    return typer.Option(
        "tensor", "--sharding", help="Under mlx.launch with several ranks: how the target is split (tensor; "
        "pipeline is refused). The drafter runs whole on every rank; rank 0 reads and writes.",
    )


def seed_option():
    return typer.Option(
        None, "--seed", min=0, max=2**64 - 1,
        help="PRNG seed, for reproducible sampling at a fixed --block-size (with auto, the draws follow "
        "the widths chosen, which follow timings).",
    )


def _block_size_value(value):
    """Checked at parse time, as typer checks an int option (before stdin is read)."""
    if value is None or value == "auto":
        return value
    try:
        return str(int(value))
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not an integer or 'auto'.") from None


def _tree_budget_value(value):
    if value is None or value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a node count or 'auto'.") from None
    if n < 1:
        raise typer.BadParameter(f"{n} is not a node count >= 1 or 'auto'.")
    return value


def block_size_option():
    return typer.Option(
        "auto", "--block-size", callback=_block_size_value,
        help="auto (default): draft at the trained block size and verify the width that measured "
        "timings say commits the most tokens per second, plain decoding included; or a fixed B, "
        "2..the drafter's trained size.",
    )


def tree_budget_option():
    return typer.Option(
        None, "--tree-budget", callback=_tree_budget_value,
        help="DDTree: verify the N most likely draft prefixes as one tree (e.g. 32), or auto (budgets and "
        "chains chosen by measured cost). Attention-only targets; hybrid targets keep chains and say so.",
    )


def drafter_flag_given(block_size, tree_budget=None) -> bool:
    """Whether a flag that needs a drafter was given (``--block-size auto`` is the default)."""
    return (block_size not in (None, "auto")) or tree_budget is not None


def recalibrate_option():
    return typer.Option(
        False, "--recalibrate",
        help="Time the widths again for --block-size auto instead of reusing the calibration kept for this "
        "model pair and machine (in $DFLASH_CACHE_DIR, default ~/.cache/dflash-mlx); what was learned of the "
        "drafter's acceptance is kept.",
    )


def draft_window_option():
    return typer.Option(
        None, "--draft-window",
        help="SINK,WINDOW: the drafter keeps its first SINK and last WINDOW context rows (e.g. 64,1024), "
        "so drafting cost stops growing with the context. Off by default.",
    )


def parse_draft_window(value: Optional[str]) -> Optional[tuple[int, int]]:
    """``--draft-window SINK,WINDOW`` -> ``(sink, window)``; None when not given.

    Raises:
        InputError: not two integers, SINK < 0 or WINDOW < 1 (names the flag).
    """
    if value is None:
        return None
    parts = value.split(",")
    try:
        sink, window = (int(p) for p in parts)
    except ValueError:
        raise InputError(f"--draft-window {value}: expected SINK,WINDOW, e.g. 64,1024") from None
    if sink < 0 or window < 1:
        raise InputError(f"--draft-window {value}: SINK must be >= 0 and WINDOW >= 1")
    return sink, window


def system_prompt_option():
    return typer.Option(
        None, "--system-prompt",
        help="System prompt for the chat template; without one, plain text before the prompt (with a warning).",
    )


def stop_option():
    return typer.Option(
        [], "--stop",
        help="Stop the reply at this text, which is not printed; repeatable. \\n and \\t are expanded.",
    )


def parse_stops(values) -> Tuple[str, ...]:
    """``--stop`` values with ``\\n`` and ``\\t`` expanded (as in ``--prompt``).

    Raises:
        InputError: an empty stop string.
    """
    stops = tuple(v.replace("\\n", "\n").replace("\\t", "\t") for v in values or ())
    if any(not s for s in stops):
        raise InputError("--stop needs a non-empty text")
    return stops


# Ctrl-C is seen between two evaluations, so one prefill chunk is the longest wait.
# mlx-lm's 2048 tokens take seconds on a large target; measured on a 2-core CPU at a
# Qwen3-0.6B width, 512-token chunks still make it wait 1.4 s (median), 128-token ones
# 0.2 s and prefill no slower (docs/benchmarks.md). A GPU's chunks are several times
# faster, and small ones waste it, so it keeps 512.
PREFILL_STEP_GPU, PREFILL_STEP_CPU = 512, 128


def prefill_step_option():
    return typer.Option(
        None, "--prefill-step-size",
        help=f"Prompt tokens per prefill chunk; Ctrl-C waits for the chunk in flight. "
        f"Default: {PREFILL_STEP_GPU} on a GPU, {PREFILL_STEP_CPU} on a CPU.",
    )


def resolve_prefill_step(value: Optional[int]) -> int:
    """``--prefill-step-size``, or the default of the device MLX runs on.

    Raises:
        InputError: a value below 1.
    """
    if value is None:
        import mlx.core as mx

        return PREFILL_STEP_GPU if mx.default_device() == mx.gpu else PREFILL_STEP_CPU
    check_number("--prefill-step-size", value, at_least=1)
    return value


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error on stderr and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def resolve_models(model: Optional[str], draft_model: Optional[str], verify: bool = False) -> tuple[str, Optional[str]]:
    """Defaults: no flags -> the Qwen3-4B pair; --model alone -> plain decoding, unless
    it is a `dflash convert` folder (its target/ and drafter/; hashes checked if ``verify``).

    Raises:
        InputError: ``--draft-model`` or ``--verify`` without ``--model``.
    """
    from dflash_mlx.pair.manifest import resolve_pair

    if verify and model is None:
        raise InputError("--verify needs --model DIR, a folder written by dflash convert")
    if model is None and draft_model is not None:
        raise InputError(f"--draft-model needs --model, the target it drafts for "
                         f"(with neither flag: {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL})")
    if model is None and draft_model is None:
        return DEFAULT_MODEL, DEFAULT_DRAFT_MODEL
    model, draft_model = resolve_pair(model, draft_model, verify)
    return model or DEFAULT_MODEL, draft_model


def warn(message: str) -> None:
    """Print a one-line warning on stderr."""
    typer.echo(f"warning: {message}", err=True)


def utf8(text: str) -> Tuple[str, bool]:
    """Text read with ``surrogateescape`` (argv, or stdin read that way) as valid UTF-8.

    Bytes that are not UTF-8 become U+FFFD, as ``bytes.decode(errors="replace")`` does.

    Returns:
        ``(text, replaced)``: ``replaced`` is True when some bytes were invalid.
    """
    data = text.encode("utf-8", "surrogateescape")
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def read_prompt(prompt: Optional[str]) -> str:
    """``--prompt TEXT``; ``--prompt -`` or a piped stdin reads stdin.

    Like mlx-lm, ``\\n`` and ``\\t`` escapes in TEXT are expanded. Trailing newlines of
    stdin are dropped (``echo`` adds one). Bytes that are not UTF-8 are replaced by
    U+FFFD, with a warning on stderr.

    Raises:
        InputError: no prompt given, or the prompt is empty.
    """
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise InputError("no prompt: pass --prompt TEXT, --prompt - or pipe it on stdin")
        text = sys.stdin.buffer.read().decode("utf-8", "surrogateescape").rstrip("\n")
    else:
        text = prompt.replace("\\n", "\n").replace("\\t", "\t")
    text, replaced = utf8(text)
    if replaced:
        warn("the prompt is not valid UTF-8: the invalid bytes were replaced by U+FFFD")
    if not text.strip():
        raise InputError("the prompt is empty: give some text with --prompt or on stdin")
    return text


def parse_template_config(value: Optional[str]) -> dict:
    """Parse ``--chat-template-config`` (a JSON object)."""
    if value is None:
        return {}
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise InputError(f"--chat-template-config is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError("--chat-template-config must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return config


def check_sampling(temp: float, top_p: float, top_k: int, min_p: float, max_tokens: int) -> None:
    """Range checks for the sampling flags; errors name the flag."""
    check_temp(temp)
    check_number("--top-p", top_p, above=0, at_most=1)
    check_number("--top-k", top_k, at_least=0)
    check_number("--min-p", min_p, at_least=0, at_most=1)
    check_max_tokens(max_tokens)


def check_temp(temp: float, name: str = "--temp") -> None:
    """Raises InputError naming ``name`` (the flag, or the chat command) unless 0 <= temp < inf."""
    check_number(name, temp, at_least=0)


def check_max_tokens(max_tokens: int, name: str = "--max-tokens") -> None:
    """Raises InputError naming ``name`` if max_tokens < 1."""
    check_number(name, max_tokens, at_least=1)


def check_system_prompt(system_prompt: Optional[str], tokenizer, ignore_chat_template: bool) -> None:
    """Warn (one line) when a system prompt has no chat template to go into: it is then
    put before the first turn as plain text."""
    if system_prompt is None:
        return
    if ignore_chat_template or not tokenizer.has_chat_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "this model has no chat template"
        warn(f"{why}: the --system-prompt text goes before the prompt as plain text")


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str], template: dict,
                  ignore_chat_template: bool) -> list[int]:
    """Apply the chat template as ``mlx_lm.generate`` does, then tokenize. Without one,
    the raw text (after the system prompt, if any, as ``dflash chat`` does)."""
    from dflash_mlx.prompt import encode_messages
    from dflash_mlx.chat.session import plain_text

    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    return encode_messages(tokenizer, messages, template, use_template=not ignore_chat_template,
                           plain=plain_text)


def quiet_transformers() -> None:
    """No transformers warnings (e.g. "sequence length is longer than ...") on stderr:
    the CLI checks lengths itself and says so in one line."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def load_pair(model: str, draft_model: Optional[str], defaults: bool, draft_window=None, recalibrate: bool = False,
              sharding: Optional[str] = None):
    """Load the pair; when the defaults cannot be had, say how to pass folders.
    ``recalibrate``: its first generation re-times the widths (``--recalibrate``); ``sharding``:
    split the target over the ranks (:func:`dflash_mlx.pair.sharded.join_ranks`)."""
    from dflash_mlx import CheckpointError, load
    from dflash_mlx.decode.policy import recalibrate as recalibrate_next

    from .render import spinner

    quiet_transformers()
    try:
        with spinner(f"loading {model}" + (f" and {draft_model}" if draft_model else "")):
            pair = load(model, draft_model, draft_window=draft_window, sharding=sharding)
        if recalibrate and pair.drafter is not None:
            recalibrate_next(pair.drafter)
        return pair
    except CheckpointError as e:
        if not defaults:
            raise
        raise CheckpointError(
            f"the default pair {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL} is not available "
            f"({e}). Pass local folders instead: --model DIR --draft-model DIR"
        ) from None


def check_out_folder(path, flag: str = "--out") -> None:
    """Refuse an output folder that cannot be made, before any model is loaded:
    the path, or a folder above it, is a file.

    Raises:
        InputError: naming the flag and the file in the way.
    """
    path = Path(path)
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is under {p}, which is a file"
                raise InputError(f"{flag} {path} {where}, not a folder")
            return


def guard(fn):
    """Run ``fn``; DFlashError becomes a one-line error and exit code 1.

    A closed output pipe (``dflash generate ... | head``) stops the work quietly with
    exit code 141 (128 + SIGPIPE), the status ``yes | head`` gives ``yes``. A closed
    stdin or stdout, or one that cannot be written, is a one-line error
    (``dflash_mlx/cli/stdio.py``); so is a file system error on a named path.
    """
    try:
        result = fn()
        sys.stdout.flush()  # a write that fails (> /dev/full) surfaces here, as a StreamError
        return result
    except DFlashError as e:
        fail(str(e))
    except BrokenPipeError:
        # Python ignores SIGPIPE, so the write raised instead; what is still buffered
        # for stdout goes nowhere rather than raising again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(141)
    except OSError as e:  # a path the system refused (--out under a file, no permission, disk full)
        if e.filename is None:
            raise
        fail(f"{e.filename}: {e.strerror or e}")
