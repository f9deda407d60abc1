"""The flags the commands share (each an ``Annotated`` alias), their checks, prompt reading, errors; output a
person reads: tables that fit the terminal (plain text in pipes and logs), progress bars and a spinner."""

import json
import os
import sys
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Annotated, Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table
from typer import Option

from dflash_mlx.errors import CheckpointError, DFlashError, InputError
from dflash_mlx.hub import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from dflash_mlx.ranges import check_number

from .fit import WIDE, columns, fit_table, folded, piped, plain

MODEL_HELP = (
    "Target model: a local mlx-lm folder or a Hugging Face repo id (downloaded into the HF cache). Default with "
    f"neither flag: {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL}. A folder written by `dflash convert` gives both."
)
PREFILL_STEP_GPU, PREFILL_STEP_CPU = 512, 128  # Ctrl-C waits for one chunk: small ones on a CPU


def _parsed(parser: str):
    """A click callback parsing with ``dflash_mlx.decode.width.<parser>``; InputError becomes a usage error."""
    def callback(ctx: typer.Context, value):
        from dflash_mlx.decode import width

        try:
            return getattr(width, parser)(value)
        except InputError as e:
            ctx.fail(str(e))

    return callback


Model = Annotated[Optional[str], Option("--model", help=MODEL_HELP)]
DraftModel = Annotated[Optional[str], Option("--draft-model", help="DFlash drafter: a local folder or repo id.")]
Verify = Annotated[bool, Option("--verify", help="Check a `dflash convert` folder's sha256 hashes first.")]
MaxTokens = Annotated[int, Option("--max-tokens", "-m", help="Most tokens to generate (per reply).")]
Temp = Annotated[float, Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, Option("--top-p", help="Nucleus sampling mass, in (0, 1].")]
TopK = Annotated[int, Option("--top-k", help=(
    "Sample from the k most likely tokens; 0, or the vocabulary size and above, is off."))]
MinP = Annotated[float, Option("--min-p", help="Min-p threshold, in [0, 1]; 0 is off.")]
Seed = Annotated[Optional[int], Option("--seed", min=0, max=2**64 - 1, help="PRNG seed.")]
BlockSize = Annotated[str, Option("--block-size", callback=_parsed("parse_block_size"), help=(
    "auto: verify the width measured timings say is fastest; or B, 2..the drafter's trained size."))]
def _lookup(ctx: typer.Context, value: str) -> str:
    return value if value in ("auto", "off") else ctx.fail(f"--prompt-lookup must be auto or off, got {value!r}")


PromptLookup = Annotated[str, Option("--prompt-lookup", callback=_lookup, help=(
    "auto: also verify drafts copied from the prompt and the reply where their last tokens occurred "
    "before (paused while copies miss); off: never."))]
TreeBudget = Annotated[Optional[str], Option("--tree-budget", callback=_parsed("parse_tree_budget"), help=(
    "DDTree: verify the N most likely draft prefixes as one tree (e.g. 32), or auto."))]
Sharding = Annotated[Optional[str], Option("--sharding", help=(
    "Under mlx.launch: tensor (split every layer, the default) or pipeline (split the layers)."))]
DraftWindow = Annotated[Optional[str], Option("--draft-window", help=(
    "SINK,WINDOW: the drafter keeps its first SINK and last WINDOW context rows (e.g. 64,1024)."))]
SystemPrompt = Annotated[Optional[str], Option("--system-prompt", help="System prompt for the chat template.")]
Stop = Annotated[List[str], Option("--stop", help="Stop the reply at this text (not printed); repeatable.")]
TemplateConfig = Annotated[Optional[str], Option("--chat-template-config", help=(
    "JSON for apply_chat_template, e.g. '{\"enable_thinking\": true}' (off by default with a drafter)."))]
IgnoreTemplate = Annotated[bool, Option("--ignore-chat-template", help="Use the raw text, no chat template.")]
PrefillStep = Annotated[Optional[int], Option("--prefill-step-size", help=(
    f"Prompt tokens per prefill chunk (default {PREFILL_STEP_GPU} on a GPU, {PREFILL_STEP_CPU} on a CPU)."))]
PromptCacheDir = Annotated[Optional[str], Option("--prompt-cache-dir", help=(
    "Folder of the prompt cache (default: $DFLASH_CACHE_DIR/prompts, else ~/.cache/dflash-mlx/prompts)."))]
NoPromptCache = Annotated[bool, Option("--no-prompt-cache", help=(
    "Neither read nor write the prompt cache (nor what --block-size auto learned)."))]
PromptCacheGb = Annotated[float, Option("--prompt-cache-gb", help="Most GB (2^30 bytes) the prompt cache keeps.")]


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print a warning on stderr, one line folded to the terminal's width (:func:`~.fit.folded`)."""
    typer.echo(folded([f"warning: {message}"]), err=True)


def check_pair_flags(o) -> None:
    """Check and resolve the flags ``o`` of generate, chat or serve in place; InputError naming the flag."""
    o.tree_budget = getattr(o, "tree_budget", None)
    o.template = parse_template_config(o.chat_template_config)
    o.defaults = o.model is None and o.draft_model is None
    o.model, o.draft_model = resolve_models(o.model, o.draft_model, getattr(o, "verify", False))
    if o.prefill_step_size is None:
        import mlx.core as mx

        o.prefill_step_size = PREFILL_STEP_GPU if mx.default_device() == mx.gpu else PREFILL_STEP_CPU
    check_number("--prefill-step-size", o.prefill_step_size, at_least=1)
    for flag, given, why in (("--block-size", o.block_size not in (None, "auto"), "plain decoding has no blocks"),
                             ("--tree-budget", o.tree_budget is not None, "plain decoding has no drafts"),
                             ("--compare", getattr(o, "compare", False), "it compares DFlash with plain decoding")):
        if given and o.draft_model is None:
            raise InputError(f"{flag} needs --draft-model ({why})")
    check_number("--prompt-cache-gb", o.prompt_cache_gb, above=0)
    o.store = None
    if not o.no_prompt_cache:
        from dflash_mlx.prompt_cache.store import PrefixStore

        root = Path(o.prompt_cache_dir).expanduser() if o.prompt_cache_dir else None
        if root is not None:
            check_out_folder(root, "--prompt-cache-dir")
        o.store = PrefixStore(root, max_bytes=int(o.prompt_cache_gb * 2**30))
    if o.draft_model is not None:
        o.template.setdefault("enable_thinking", False)


def check_sampling(temp: float, top_p: float, top_k: int, min_p: float, max_tokens: int) -> None:
    """Range checks of the sampling flags; errors name the flag."""
    check_number("--temp", temp, at_least=0)
    check_number("--top-p", top_p, above=0, at_most=1)
    check_number("--top-k", top_k, at_least=0)
    check_number("--min-p", min_p, at_least=0, at_most=1)
    check_number("--max-tokens", max_tokens, at_least=1)


def parse_draft_window(value: Optional[str]) -> Optional[tuple[int, int]]:
    """``--draft-window SINK,WINDOW`` -> ``(sink, window)`` or None; InputError naming the flag."""
    if value is None:
        return None
    try:
        sink, window = (int(p) for p in value.split(","))
    except ValueError:
        raise InputError(f"--draft-window {value}: expected SINK,WINDOW, e.g. 64,1024") from None
    if sink < 0 or window < 1:
        raise InputError(f"--draft-window {value}: SINK must be >= 0 and WINDOW >= 1")
    return sink, window


def unescape(text: str) -> str:
    """``\\n`` and ``\\t`` in a flag's text expanded, as mlx-lm does for ``--prompt``."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def parse_stops(values) -> Tuple[str, ...]:
    """``--stop`` values, escapes expanded. Raises InputError for an empty one."""
    stops = tuple(unescape(v) for v in values or ())
    if any(not s for s in stops):
        raise InputError("--stop needs a non-empty text")
    return stops


def resolve_models(model: Optional[str], draft_model: Optional[str], verify: bool = False) -> tuple[str, Optional[str]]:
    """No flags: the default pair; ``--model`` alone: plain, or a `dflash convert` folder's pair.
    InputError: ``--draft-model`` or ``--verify`` without ``--model``."""
    from dflash_mlx.pair.manifest import resolve_pair

    if verify and model is None:
        raise InputError("--verify needs --model DIR, a folder written by dflash convert")
    if model is None and draft_model is not None:
        raise InputError(f"--draft-model needs --model, the target it drafts for "
                         f"(with neither flag: {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL})")
    return (DEFAULT_MODEL, DEFAULT_DRAFT_MODEL) if model is None else resolve_pair(model, draft_model, verify)


def utf8(text: str) -> Tuple[str, bool]:
    """Text read with ``surrogateescape`` as valid UTF-8 (bad bytes become U+FFFD); True if any were."""
    data = text.encode("utf-8", "surrogateescape")
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def read_prompt(prompt: Optional[str]) -> str:
    """``--prompt TEXT`` (escapes expanded), or stdin (``-`` or piped) without trailing newlines; bad UTF-8
    becomes U+FFFD with a warning. InputError: no prompt, or an empty one."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise InputError("no prompt: pass --prompt TEXT, --prompt - or pipe it on stdin")
        text = sys.stdin.buffer.read().decode("utf-8", "surrogateescape").rstrip("\n")
    else:
        text = unescape(prompt)
    text, replaced = utf8(text)
    if replaced:
        warn("the prompt is not valid UTF-8: the invalid bytes were replaced by U+FFFD")
    if not text.strip():
        raise InputError("the prompt is empty: give some text with --prompt or on stdin")
    return text


def parse_template_config(value: Optional[str]) -> dict:
    """``--chat-template-config``: a JSON object (else InputError)."""
    if value is None:
        return {}
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise InputError(f"--chat-template-config is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError("--chat-template-config must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return config


def check_template_flags(tokenizer, system_prompt: Optional[str] = None, template_config: Optional[str] = None,
                         ignore_chat_template: bool = False) -> None:
    """One warning per chat-template flag given with no chat template to take it: ``--system-prompt`` (its text
    then goes before the first turn) and ``--chat-template-config`` (not used)."""
    if ignore_chat_template or not tokenizer.has_chat_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "this model has no chat template"
        if system_prompt is not None:
            warn(f"{why}: the --system-prompt text goes before the prompt as plain text")
        if template_config is not None:
            warn(f"{why}: --chat-template-config is not used")


def load_pair(model: str, draft_model: Optional[str], defaults: bool, draft_window=None, sharding=None):
    """:func:`~dflash_mlx.pair.loading.load` under a spinner; the default pair's CheckpointError names local folders."""
    from transformers.utils import logging as hf_logging

    from dflash_mlx.pair.loading import load

    hf_logging.set_verbosity_error()  # the CLI checks lengths itself
    try:
        with spinner(f"loading {model}" + (f" and {draft_model}" if draft_model else "")):
            pair = load(model, draft_model, draft_window=draft_window, sharding=sharding)
    except CheckpointError as e:
        if not defaults:
            raise
        raise CheckpointError(f"the default pair {DEFAULT_MODEL} + {DEFAULT_DRAFT_MODEL} is not available "
                              f"({e}). Pass local folders instead: --model DIR --draft-model DIR") from None
    return pair


def check_out_folder(path, flag: str = "--out") -> None:
    """InputError naming ``flag`` and the file in the way when ``path`` or a folder above it is a file."""
    path = Path(path)
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is under {p}, which is a file"
                raise InputError(f"{flag} {path} {where}, not a folder")
            return


def silence_stdout() -> None:
    """Point descriptor 1 at /dev/null, so what is still buffered does not fail again at exit."""
    with suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def guard(fn):
    """Run ``fn``: a DFlashError or an OSError on a path is one line and exit 1; a closed pipe exits 141."""
    try:
        result = fn()
        sys.stdout.flush()  # a write that fails (> /dev/full) surfaces here, as a StreamError
        return result
    except DFlashError as e:
        fail(str(e))
    except BrokenPipeError:
        silence_stdout()
        raise typer.Exit(141)
    except OSError as e:
        if e.filename is None:
            raise
        fail(f"{e.filename}: {e.strerror or e}")


def print_table(table: Table, console: Optional[Console] = None, drop: Sequence[str] = ()) -> None:
    """Print ``table`` on ``console`` (default: stdout): fitted to a terminal (:func:`fitted`); else plain text
    (no box, colour or trailing spaces), a row per line unless ``COLUMNS`` is set: then fitted to it too, with
    the columns in ``drop`` the first to go (:func:`~dflash_mlx.cli.fit.fit_table`)."""
    console = console or Console()
    if console.is_terminal:
        console.print(fitted(table, console.width, drop))
        return
    title, table.title = table.title, None  # on a line of its own, whole unless COLUMNS is set
    table.box, table.show_edge, table.pad_edge = None, False, False
    width = columns()
    text = plain([table], Console(width=WIDE).measure(table).maximum) if width is None else plain(
        [fit_table(table, width, drop)], width)
    console.file.write((piped([title]) if title else "") + text)
    console.file.flush()


def fitted(table: Table, width: int, drop: Sequence[str] = ()) -> Table:
    """``table`` made to fit ``width`` columns: a light box, text folded at word boundaries, never cut to
    ``…``, a number never split (:func:`~dflash_mlx.cli.fit.fit_table`, which drops the columns in ``drop``
    first when their words do not fit)."""
    table.box, table.show_edge, table.pad_edge, table.collapse_padding = box.SIMPLE_HEAD, False, False, True
    return fit_table(table, width, drop)


def spinner(text: str) -> ContextManager:
    """A spinner with ``text`` on stderr while the body runs, only when stderr is a terminal."""
    console = Console(stderr=True)
    return console.status(text) if console.is_terminal else nullcontext()


def bars(console: Console, status: bool = False) -> Progress:
    """Progress bars on ``console``: name, bar, done/total, with ``status`` the task's ``status`` field, elapsed
    time and ETA. The bar takes the width the rest leaves; on a narrow line the name and status fold at word
    boundaries; the counts and times stay whole."""
    def text(template: str) -> TextColumn:
        return TextColumn(template, table_column=Column(overflow="fold"))

    whole = Column(no_wrap=True)
    bar = BarColumn(bar_width=None, table_column=Column(ratio=1))
    return Progress(text("{task.description}"), bar, MofNCompleteColumn(table_column=whole),
                    *([text("{task.fields[status]}")] if status else []), TimeElapsedColumn(table_column=whole),
                    TextColumn("ETA"), TimeRemainingColumn(table_column=whole), console=console, expand=True)


@contextmanager
def progress_bars(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """Yields ``progress(name, done, total)``: a bar per name on ``console``, shown from the first call."""
    bar, tasks = bars(console), {}

    def progress(name: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        bar.update(tasks[name], completed=done)

    try:
        yield progress
    finally:
        if tasks:
            bar.stop()
