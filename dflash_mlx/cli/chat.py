"""``dflash chat``: a terminal chat; caches kept across turns, live acceptance stats.

Wiring only: flags, :class:`dflash_mlx.chat.session.ChatSession`, and a view from
``chat_ui`` (rich in a terminal, plain text when stdin or stdout is not one).
"""

from __future__ import annotations

import sys
from contextlib import closing
from dataclasses import dataclass
from typing import List, Optional, Tuple

import typer

from .common import (
    check_max_tokens, check_sampling, check_system_prompt, check_temp, guard, load_pair, parse_stops,
    parse_template_config, resolve_models, resolve_prefill_step, utf8,
    block_size_option, draft_model_option, min_p_option, model_option, prefill_step_option, seed_option,
    stop_option, system_prompt_option, temp_option, top_k_option, top_p_option, draft_window_option,
    parse_draft_window,
)
from .common import verify_option
from .prompt_cache import make_store, no_prompt_cache_option, prompt_cache_dir_option, prompt_cache_gb_option

COMMANDS = [
    ("/help", "this list"),
    ("/reset", "clear the history and both caches"),
    ("/stats", "the session's acceptance histogram, totals and cache offsets"),
    ("/block N|auto", "block size, 2..the drafter's trained size, or auto (width by measured cost)"),
    ("/temp T", "sampling temperature (0 is greedy)"),
    ("/max N", "most tokens per reply"),
    ("/think on|off", "thinking, for chat templates that have it"),
    ("/color [on|off]", "colour the tokens accepted from the drafter"),
    ("/save FILE", "save the transcript: FILE.json as JSON, else Markdown"),
    ("/quit", "exit (Ctrl-D too)"),
]


@dataclass
class Settings:
    """What the commands change between turns."""

    max_tokens: int
    temp: float
    top_p: float
    top_k: int
    min_p: float
    block_size: Optional[int]
    vocab_size: Optional[int] = None
    stop: Tuple[str, ...] = ()

    def sampler(self):
        from dflash_mlx.sampling import make_sampler

        return make_sampler(self.temp, self.top_p, self.min_p, self.top_k, self.vocab_size)


def chat(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_model_option(),
    verify: bool = verify_option(),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens per reply."),
    temp: float = temp_option(),
    top_p: float = top_p_option(),
    top_k: int = top_k_option(),
    min_p: float = min_p_option(),
    seed: Optional[int] = seed_option(),
    block_size: str = block_size_option(),
    draft_window: Optional[str] = draft_window_option(),
    system_prompt: Optional[str] = system_prompt_option(),
    stop: List[str] = stop_option(),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config",
        help="JSON for apply_chat_template, e.g. '{\"enable_thinking\": true}'. "
        "With a drafter, thinking is off unless set here or with /think on.",
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Concatenate the turns' text instead of using the template."
    ),
    prefill_step_size: Optional[int] = prefill_step_option(),
    color: bool = typer.Option(True, "--color/--no-color", help="Colour the tokens accepted from the drafter."),
    session_file: Optional[str] = typer.Option(
        None, "--session", help="Keep the conversation in this JSON file and resume it when it exists: with the "
        "prompt cache on, a later process prefills only the new turn, not the history."),
    prompt_cache_dir: Optional[str] = prompt_cache_dir_option(),
    no_prompt_cache: bool = no_prompt_cache_option(),
    prompt_cache_gb: float = prompt_cache_gb_option(),
) -> None:
    """Chat in the terminal. Both caches are kept across turns; Ctrl-C stops a reply.

    Models without a chat template (base models) see the turns' text concatenated.
    When stdin is not a terminal, each line is a turn (or a /command) and the
    replies are written as plain text; a line that fails prints an error and the
    next lines still run, and the exit code is then 1.

    \b
    Examples:
      dflash chat
      dflash chat --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16
      printf 'Once upon a time\\n/stats\\n' | dflash chat --model ./stories260K
      dflash chat --session ~/notes/chat.json
    """
    args = dict(locals())
    try:
        guard(lambda: _run(**args))
    except KeyboardInterrupt:  # while loading
        raise typer.Exit(130)


def _run(model, draft_model, verify, max_tokens, temp, top_p, top_k, min_p, seed, block_size, draft_window,
         system_prompt, stop, chat_template_config, ignore_chat_template, prefill_step_size, color,
         session_file, prompt_cache_dir, no_prompt_cache, prompt_cache_gb) -> None:
    import mlx.core as mx

    from dflash_mlx.chat.session_file import read_session
    from dflash_mlx.errors import InputError

    # Flags first, then the imports of mlx-lm and transformers (2-3 s): a bad flag is
    # reported at once.
    check_sampling(temp, top_p, top_k, min_p, max_tokens)
    stops = parse_stops(stop)
    window = parse_draft_window(draft_window)
    template = parse_template_config(chat_template_config)
    defaults = model is None and draft_model is None
    model, draft_model = resolve_models(model, draft_model, verify)
    prefill_step_size = resolve_prefill_step(prefill_step_size)
    history = read_session(session_file) if session_file else []
    from dflash_mlx.decode.width import parse_block_size

    block_size = parse_block_size(block_size)
    if block_size not in (None, "auto") and draft_model is None:
        raise InputError("--block-size needs --draft-model (plain decoding has no blocks)")
    store = make_store(prompt_cache_dir, no_prompt_cache, prompt_cache_gb)

    from dflash_mlx.chat.session import ChatSession
    from dflash_mlx.decode.generate import check_block_size

    from .chat_ui import PlainView, RichView

    if draft_model is not None:
        template.setdefault("enable_thinking", False)
    if seed is not None:
        mx.random.seed(seed)

    pair = load_pair(model, draft_model, defaults, window)
    check_block_size(block_size, pair.drafter)
    check_system_prompt(system_prompt, pair.tokenizer, ignore_chat_template)
    session = ChatSession.from_pair(pair, system_prompt=system_prompt, template_config=template,
                                    use_template=not ignore_chat_template, prefill_step_size=prefill_step_size,
                                    store=store)
    settings = Settings(max_tokens, temp, top_p, top_k, min_p, block_size, pair.target.vocab_size, stops)
    view = RichView(color) if sys.stdin.isatty() and sys.stdout.isatty() else PlainView()
    view.header(header_rows(pair, session, settings))
    if history:
        session.messages = history
        view.notice(f"resumed {len(history)} messages from {session_file}")
    if _loop(session, settings, view, pair, session_file) and not view.interactive:
        raise typer.Exit(1)  # a piped script with a failed line (or a session never written) fails


def _loop(session, settings: Settings, view, pair, session_file: Optional[str] = None) -> int:
    """Read and run lines until /quit or the end of input; returns how many failed.
    With ``session_file``, the conversation is written there after every line (a write
    that fails warns once and is tried again after the next line; still unwritten at
    the end, it counts as a failure)."""
    from dflash_mlx import DFlashError
    from dflash_mlx.chat.session import ContextFullError
    from dflash_mlx.chat.session_file import SessionWriter

    failed = 0
    writer = SessionWriter(session_file, view.notice) if session_file else None
    while True:
        try:
            line, replaced = utf8(view.read())
            line = line.strip()
        except EOFError:  # Ctrl-D, or the end of piped input
            if view.interactive:
                print()
            break
        except KeyboardInterrupt:  # at the prompt: a fresh line in a terminal, else quit
            if not view.interactive:
                break
            print()
            continue
        if replaced:
            view.notice("warning: the line is not valid UTF-8: the invalid bytes were replaced by U+FFFD")
        if not line:
            continue
        try:
            if line.startswith("/"):
                if _command(line, session, settings, view, pair):
                    break
            else:
                _turn(line, session, settings, view)
        except KeyboardInterrupt:
            view.notice("interrupted")
        except ContextFullError as e:
            view.error(f"{e} (/reset)")
            failed += 1
        except DFlashError as e:
            view.error(str(e))
            failed += 1
        finally:
            if writer is not None:
                writer.save(session.messages)
    if writer is not None and writer.failing and not writer.save(session.messages):
        view.error(f"--session {session_file}: the conversation was not written")
        failed += 1
    return failed


def _turn(text: str, session, settings: Settings, view) -> None:
    from .chat_ui import summary_line

    events = session.stream(text, sampler=settings.sampler(), max_tokens=settings.max_tokens,
                            block_size=settings.block_size, stop_strings=settings.stop)
    with closing(events):
        last, interrupted = view.stream(events)
    if last is not None:
        view.summary(summary_line(last.stats, interrupted))
    if interrupted:
        view.notice(f"stopped: both caches rolled back to {len(session.tokens)} tokens")
    if session.context_left is not None and session.context_left <= 0:
        view.notice(f"the context ({session.max_context} tokens) is full: /reset to start over")


def _command(line: str, session, settings: Settings, view, pair) -> bool:
    """Run one /command; returns True to quit."""
    from dflash_mlx import InputError

    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit", "/q"):
        return True
    if name == "/help":
        w = max(len(c) for c, _ in COMMANDS)
        view.output([f"{c.ljust(w)}  {h}" for c, h in COMMANDS])
    elif name == "/reset":
        session.reset()
        view.notice("reset: history and caches cleared")
    elif name == "/stats":
        view.output(session.stats_lines())
    elif name == "/block":
        if pair.drafter is None:
            raise InputError("/block needs a drafter (--draft-model)")
        trained = pair.drafter.block_size
        B = "auto" if arg.strip() == "auto" else _number(arg, int, "/block N")
        if B != "auto" and not 2 <= B <= trained:
            raise InputError(f"/block {B} is out of range: this drafter supports 2..{trained} "
                             "(its trained block size)")
        settings.block_size = B
        view.notice(f"block size {B}")
    elif name == "/temp":
        T = _number(arg, float, "/temp T")
        check_temp(T, "/temp")
        settings.temp = T
        view.notice(f"temperature {T}")
    elif name == "/max":
        n = _number(arg, int, "/max N")
        check_max_tokens(n, "/max")
        settings.max_tokens = n
        view.notice(f"max tokens {settings.max_tokens}")
    elif name == "/think":
        if arg not in ("on", "off"):
            raise InputError("usage: /think on|off")
        session.thinking = arg == "on"
        note = "" if session.use_template else " (this model has no chat template: no effect)"
        view.notice(f"thinking {arg}{note}")
    elif name == "/color":
        if arg not in ("", "on", "off"):
            raise InputError("usage: /color [on|off]")
        view.set_color((not view.color) if not arg else arg == "on")
    elif name == "/save":
        if not arg:
            raise InputError("usage: /save FILE (FILE.json for JSON, else Markdown)")
        try:
            path = session.save(arg, meta={"model": pair.model_path, "draft_model": pair.draft_path})
        except OSError as e:
            raise InputError(f"{arg}: cannot write ({e.strerror})") from None
        view.notice(f"saved {len(session.messages)} messages to {path}")
    else:
        raise InputError(f"unknown command {name}: /help lists them")
    return False


def _number(arg: str, kind, usage: str):
    from dflash_mlx import InputError

    try:
        return kind(arg)
    except ValueError:
        raise InputError(f"usage: {usage}") from None


def header_rows(pair, session, settings: Settings) -> List[Tuple[str, str]]:
    """What the header panel shows: the pair, block size, quantization, memory, context."""
    import mlx.core as mx

    drafter = pair.drafter
    rows = [("target", str(pair.model_path))]
    if drafter is not None:
        B = settings.block_size or drafter.block_size
        shown = "auto (width by measured cost)" if B == "auto" else str(B)
        rows += [("drafter", str(pair.draft_path)), ("block size", f"{shown} (trained {drafter.block_size})")]
    else:
        rows += [("drafter", "none (plain decoding)")]
    rows.append(("quantization", quantization(pair.model, pair.target.dtype)))
    mem = f"weights {weights_gb(pair.model):.3f} GB"
    if drafter is not None:
        mem += f" + drafter {weights_gb(drafter):.3f} GB"
    rows.append(("memory", f"{mem} · {mx.get_active_memory() / 1e9:.3f} GB in use"))
    template = "chat template" if session.use_template else "none: turns concatenated"
    limit = f"{session.max_context} tokens" if session.max_context else "unlimited"
    rows.append(("context", f"{limit} · {template}"))
    if session.use_template:
        rows.append(("thinking", {None: "template default", True: "on", False: "off"}[session.thinking]))
    rows.append(("sampling", f"temp {settings.temp} · max {settings.max_tokens} tokens"))
    return rows


def quantization(model, dtype) -> str:
    """``4-bit (group 64)`` from the model's quantized layers, or ``none (dtype)``."""
    import mlx.nn as nn

    kinds = sorted({(m.bits, m.group_size) for m in model.modules()
                    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))})
    if not kinds:
        return f"none ({str(dtype).replace('mlx.core.', '')})"
    return ", ".join(f"{b}-bit (group {g})" for b, g in kinds)


def weights_gb(module) -> float:
    """Bytes of a module's parameters, in GB."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters())) / 1e9
