"""``dflash chat``: a terminal chat over :class:`dflash_mlx.chat.session.ChatSession` (views in ``chat_ui``)."""

import json
import sys
from contextlib import closing
from types import SimpleNamespace
from typing import Annotated, List, Optional, Tuple

import typer
from typer import Option

from dflash_mlx.errors import DFlashError, InputError
from dflash_mlx.ranges import check_number

from .common import (
    BlockSize, PromptLookup, DraftModel, DraftWindow, IgnoreTemplate, MaxTokens, MinP, Model, NoPromptCache, PrefillStep,
    PromptCacheDir, PromptCacheGb, Seed, Sharding, Stop, SystemPrompt, Temp, TemplateConfig, TopK, TopP, Verify,
    check_pair_flags, check_sampling, check_template_flags, guard, load_pair, parse_draft_window, parse_stops, utf8)

COMMANDS = [
    ("/help", "this list"), ("/reset", "clear the history and both caches"),
    ("/stats", "the session's acceptance histogram, totals and cache offsets"),
    ("/block N|auto", "block size, 2..the drafter's trained size, or auto (width by measured cost)"),
    ("/temp T", "sampling temperature (0 is greedy)"), ("/max N", "most tokens per reply"),
    ("/think on|off", "thinking, for chat templates that have it"),
    ("/color [on|off]", "colour the tokens accepted from the drafter"),
    ("/save FILE", "save the transcript: FILE.json as JSON, else Markdown"), ("/quit", "exit (Ctrl-D too)")]


def chat(
    model: Model = None, draft_model: DraftModel = None, verify: Verify = False, max_tokens: MaxTokens = 256,
    temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0, seed: Seed = None,
    block_size: BlockSize = "auto", prompt_lookup: PromptLookup = "auto", draft_window: DraftWindow = None,
    system_prompt: SystemPrompt = None, stop: Stop = [], chat_template_config: TemplateConfig = None,
    ignore_chat_template: IgnoreTemplate = False, prefill_step_size: PrefillStep = None,
    color: Annotated[bool, Option("--color/--no-color", help="Colour the tokens accepted from the drafter.")] = True,
    session_file: Annotated[Optional[str], Option("--session", help="Keep the conversation in this JSON file.")] = None,
    prompt_cache_dir: PromptCacheDir = None, no_prompt_cache: NoPromptCache = False,
    prompt_cache_gb: PromptCacheGb = 8.0, sharding: Sharding = None,
) -> None:
    """Chat in the terminal. Both caches are kept across turns; Ctrl-C stops a reply.

    Piped, each line is a turn or a /command, replies are plain text, and a failed line makes the exit code 1.

    \b
    Examples:
      dflash chat --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16
      printf 'Once upon a time\\n/stats\\n' | dflash chat --model ./stories260K
      dflash chat --session ~/notes/chat.json
      mlx.launch --backend ring -n 2 -- dflash chat --model M --draft-model D
    """
    o = SimpleNamespace(**locals())
    try:
        guard(lambda: _run(o))
    except KeyboardInterrupt:  # while loading
        raise typer.Exit(130)


def _run(o) -> None:
    from dflash_mlx.chat.session_file import read_session

    check_sampling(o.temp, o.top_p, o.top_k, o.min_p, o.max_tokens)  # flags first, then the 2-3 s of imports
    o.stop, window = parse_stops(o.stop), parse_draft_window(o.draft_window)
    check_pair_flags(o)
    from dflash_mlx.pair.sharded import join_ranks, rank, share_text

    distributed = join_ranks(o.sharding)
    if distributed is not None:  # rank 0 alone reads and writes files; one prompt cache per rank would differ
        o.store, o.session_file = None, o.session_file if rank() == 0 else None
    history = json.loads(share_text(lambda: json.dumps(read_session(o.session_file) if o.session_file else [])))
    import mlx.core as mx

    from dflash_mlx.chat.session import ChatSession
    from dflash_mlx.decode.generate import check_block_size

    from .chat_ui import PlainView, RichView

    if o.seed is not None:
        mx.random.seed(o.seed)
    pair = load_pair(o.model, o.draft_model, o.defaults, window, distributed and distributed["sharding"])
    check_block_size(o.block_size, pair.drafter)
    o.vocab_size = pair.target.vocab_size
    check_template_flags(pair.tokenizer, o.system_prompt, o.chat_template_config, o.ignore_chat_template)
    session = ChatSession.from_pair(pair, system_prompt=o.system_prompt, template_config=o.template,
                                    use_template=not o.ignore_chat_template, prefill_step_size=o.prefill_step_size,
                                    store=o.store)
    view = RichView(o.color) if sys.stdin.isatty() and sys.stdout.isatty() else PlainView()
    view.header(header_rows(pair, session, o))
    if history:
        session.messages = history
        view.notice(f"resumed {len(history)} messages from {o.session_file}")
    if _loop(session, o, view, pair) and not view.interactive:
        raise typer.Exit(1)  # a piped script with a failed line (or a session never written) fails


def _loop(session, o, view, pair) -> int:
    """Run lines until /quit or the end of input, saving ``--session`` after each; returns how many failed."""
    from dflash_mlx.chat.session_file import SessionWriter
    from dflash_mlx.pair.sharded import share_text

    failed = 0
    writer = SessionWriter(o.session_file, view.notice) if o.session_file else None
    while line := share_text(lambda: _read_line(view)):  # rank 0's line on every rank
        ok, quit = _line(line, session, o, view, pair)
        failed += not ok
        if writer is not None:
            writer.save(session.messages)
        if quit:
            break
    if writer is not None and writer.failing and not writer.save(session.messages):
        view.error(f"--session {o.session_file}: the conversation was not written")
        failed += 1
    return failed


def _read_line(view) -> str:
    """The next line that is not blank, stripped (bad UTF-8 replaced, with a warning); "" at the end of input."""
    while True:
        try:
            line, replaced = utf8(view.read())
        except EOFError:  # Ctrl-D, or the end of piped input
            if view.interactive:
                print()
            return ""
        except KeyboardInterrupt:  # at the prompt: a fresh line in a terminal, else quit
            if not view.interactive:
                return ""
            print()
            continue
        if replaced:
            view.notice("warning: the line is not valid UTF-8: the invalid bytes were replaced by U+FFFD")
        if line.strip():
            return line.strip()


def _line(line: str, session, o, view, pair) -> Tuple[bool, bool]:
    """Run one line (a /command, or a turn with its summary and notices); returns ``(ok, quit)``."""
    from dflash_mlx.chat.session import ContextFullError
    from dflash_mlx.pair.sharded import lockstep
    from dflash_mlx.sampling import Sampling

    from .chat_ui import summary_line

    try:
        if line.startswith("/"):
            return True, _command(line, session, o, view, pair)
        sampler = Sampling(o.temp, o.top_p, o.min_p, o.top_k, o.vocab_size)
        events = lockstep(session.stream(line, sampler=sampler, max_tokens=o.max_tokens, block_size=o.block_size,
                                         stop_strings=o.stop, prompt_lookup=o.prompt_lookup == "auto"))
        with closing(events):
            last, interrupted = view.stream(events)
        if last is not None:
            view.summary(summary_line(last.stats, interrupted))
        if interrupted:
            view.notice(f"stopped: both caches rolled back to {len(session.tokens)} tokens")
        if session.context_left is not None and session.context_left <= 0:
            view.notice(f"the context ({session.max_context} tokens) is full: /reset to start over")
    except KeyboardInterrupt:
        view.notice("interrupted")
    except DFlashError as e:
        view.error(f"{e} (/reset)" if isinstance(e, ContextFullError) else str(e))
        return False, False
    return True, False


def _command(line: str, session, o, view, pair) -> bool:
    """Run one /command; returns True to quit. InputError for a bad argument or command."""
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
        o.block_size = _block(arg, pair.drafter)
        view.notice(f"block size {o.block_size}")
    elif name in ("/temp", "/max"):
        temp = name == "/temp"
        value = _number(arg, float if temp else int, "/temp T" if temp else "/max N")
        check_number(name, value, at_least=0 if temp else 1)
        setattr(o, "temp" if temp else "max_tokens", value)
        view.notice(f"temperature {value}" if temp else f"max tokens {value}")
    elif name in ("/think", "/color"):
        if arg not in (("on", "off") if name == "/think" else ("", "on", "off")):
            raise InputError("usage: /think on|off" if name == "/think" else "usage: /color [on|off]")
        if name == "/color":
            view.set_color((not view.color) if not arg else arg == "on")
            return False
        session.thinking = arg == "on"
        view.notice(f"thinking {arg}" + ("" if session.use_template else
                                         " (this model has no chat template: no effect)"))
    elif name == "/save":
        if not arg:
            raise InputError("usage: /save FILE (FILE.json for JSON, else Markdown)")
        from dflash_mlx.pair.sharded import rank

        if rank() != 0:  # under mlx.launch rank 0 alone writes it
            return False
        try:
            path = session.save(arg, meta={"model": pair.model_path, "draft_model": pair.draft_path})
        except OSError as e:
            raise InputError(f"{arg}: cannot write ({e.strerror})") from None
        view.notice(f"saved {len(session.messages)} messages to {path}")
    else:
        raise InputError(f"unknown command {name}: /help lists them")
    return False


def _block(arg: str, drafter):
    from dflash_mlx.decode.generate import check_block_size

    if drafter is None:
        raise InputError("/block needs a drafter (--draft-model)")
    B = "auto" if arg == "auto" else _number(arg, int, "/block N")
    return B if B == "auto" else check_block_size(B, drafter, "/block")


def _number(arg: str, kind, usage: str):
    try:
        return kind(arg)
    except ValueError:
        raise InputError(f"usage: {usage}") from None


def header_rows(pair, session, o) -> List[Tuple[str, str]]:
    """The header panel's rows: the pair, block size, quantization, memory, context, sampling."""
    import mlx.core as mx

    from dflash_mlx.pair.loading import quantization
    from dflash_mlx.stats import weight_bytes

    drafter = pair.drafter
    rows = [("target", str(pair.model_path)), ("drafter", str(pair.draft_path) if drafter else "none (plain decoding)")]
    if drafter is not None:
        B = o.block_size or drafter.block_size
        shown = "auto (width by measured cost)" if B == "auto" else str(B)
        rows.append(("block size", f"{shown} (trained {drafter.block_size})"))
    mem = f"weights {weight_bytes(pair.model) / 1e9:.3f} GB"
    mem += f" + drafter {weight_bytes(drafter) / 1e9:.3f} GB" if drafter else ""
    mem += f" · {mx.get_active_memory() / 1e9:.3f} GB in use"
    template = "chat template" if session.use_template else "none: turns concatenated"
    limit = f"{session.max_context} tokens" if session.max_context else "unlimited"
    quant = quantization(pair.model) + (f" · drafter {quantization(drafter)}" if drafter is not None else "")
    rows += [("quantization", quant), ("memory", mem), ("context", f"{limit} · {template}")]
    if session.use_template:
        rows.append(("thinking", {None: "template default", True: "on", False: "off"}[session.thinking]))
    rows.append(("sampling", f"temp {o.temp} · max {o.max_tokens} tokens"))
    return rows
