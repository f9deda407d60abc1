"""Flags, prompt reading and error reporting shared by the commands."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from dflash_mlx.errors import DFlashError, InputError
from dflash_mlx.loading import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

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
    return typer.Option(0, "--top-k", help="Sample from the k most likely tokens; 0 is off.")


def min_p_option():
    return typer.Option(0.0, "--min-p", help="Min-p threshold, in [0, 1]; 0 is off.")


def seed_option():
    return typer.Option(None, "--seed", help="PRNG seed, for reproducible sampling.")


def block_size_option():
    return typer.Option(None, "--block-size", help="Tokens per drafted block, 2..the drafter's trained size (default).")


def system_prompt_option():
    return typer.Option(None, "--system-prompt", help="System prompt for the chat template.")


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error on stderr and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def resolve_models(model: Optional[str], draft_model: Optional[str], verify: bool = False) -> tuple[str, Optional[str]]:
    """Defaults: no flags -> the Qwen3-4B pair; --model alone -> plain decoding, unless
    it is a `dflash convert` folder (its target/ and drafter/; hashes checked if ``verify``)."""
    from dflash_mlx.manifest import resolve_pair

    if verify and model is None:
        raise InputError("--verify needs --model DIR, a folder written by dflash convert")
    if model is None and draft_model is None:
        return DEFAULT_MODEL, DEFAULT_DRAFT_MODEL
    model, draft_model = resolve_pair(model, draft_model, verify)
    return model or DEFAULT_MODEL, draft_model


def read_prompt(prompt: Optional[str]) -> str:
    """``--prompt TEXT``; ``--prompt -`` or a piped stdin reads stdin.

    Like mlx-lm, ``\\n`` and ``\\t`` escapes in TEXT are expanded. Trailing newlines of
    stdin are dropped (``echo`` adds one).

    Raises:
        InputError: no prompt given, or the prompt is empty.
    """
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise InputError("no prompt: pass --prompt TEXT, --prompt - or pipe it on stdin")
        text = sys.stdin.read().rstrip("\n")
    else:
        text = prompt.replace("\\n", "\n").replace("\\t", "\t")
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
    if temp < 0:
        raise InputError(f"--temp must be >= 0, got {temp}")
    if not 0 < top_p <= 1:
        raise InputError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InputError(f"--top-k must be >= 0, got {top_k}")
    if not 0 <= min_p <= 1:
        raise InputError(f"--min-p must be in [0, 1], got {min_p}")
    if max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {max_tokens}")


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str], template: dict,
                  ignore_chat_template: bool) -> list[int]:
    """Apply the chat template as ``mlx_lm.generate`` does (raw text without one), then tokenize."""
    from dflash_mlx.prompt import encode_messages

    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    return encode_messages(tokenizer, messages, template, use_template=not ignore_chat_template,
                           plain=lambda _: text)


def load_pair(model: str, draft_model: Optional[str], defaults: bool):
    """Load the pair; when the defaults cannot be had, say how to pass folders."""
    from dflash_mlx import CheckpointError, load

    try:
        return load(model, draft_model)
    except CheckpointError as e:
        if not defaults:
            raise
        raise CheckpointError(
            f"the default pair {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL} is not available "
            f"({e}). Pass local folders instead: --model DIR --draft-model DIR"
        ) from None


def guard(fn):
    """Run ``fn``; DFlashError becomes a one-line error and exit code 1."""
    try:
        return fn()
    except DFlashError as e:
        fail(str(e))
