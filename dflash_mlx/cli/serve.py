"""``dflash serve``: the OpenAI-compatible server (wiring over :mod:`dflash_mlx.serve.app`)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Optional

import typer

from dflash_mlx.ranges import check_number

from .common import (block_size_option, draft_model_option, guard, load_pair, model_option, prefill_step_option,
                     recalibrate_option, resolve_models, resolve_prefill_step, sharding_option)
from .prompt_cache import make_store, no_prompt_cache_option, prompt_cache_dir_option, prompt_cache_gb_option

LOG_LEVELS = ("debug", "info", "warning", "error")
BATCH_PROMPT_CACHE = ("Batched requests use it too where the target and drafter keep plain attention KV caches "
                      "and the drafter has a batched pass; else (hybrids, sliding-window layers) they prefill "
                      "whole prompts (the log says so).")
MAX_BATCH_HELP = ("Requests decoding together (continuous batching); 1: one at a time, with the prompt cache. "
                  + BATCH_PROMPT_CACHE)
MAX_BATCH = 256  # a batch's cache grows with it: a typo (8000) should not take the memory
MAX_CONNECTIONS = 128  # well under macOS's default of 256 open files per process
IDLE_TIMEOUT_HELP = ("Seconds a connection may idle between requests (uvicorn's keep-alive timeout), its request "
                     "headers may take to arrive in full, and a request body may stall between chunks (then 408).")
MAX_CONNECTIONS_HELP = ("Open connections at once; a request past it gets a 503 (keeps the server within its "
                        "file descriptors).")


def serve(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_model_option(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind. The default answers this Mac only; "
                             "anything else should go with --api-key."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    block_size: str = block_size_option(),
    recalibrate: bool = recalibrate_option(),
    max_tokens: int = typer.Option(512, "--max-tokens", "-m",
                                   help="Tokens per request when the request does not say (max_tokens)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="DFLASH_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health (or set DFLASH_API_KEY)."),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait behind the running ones; "
                                  "past that, 429."),
    max_batch: int = typer.Option(8, "--max-batch", help=MAX_BATCH_HELP),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", help="Largest request body, in MB (2^20 bytes); "
                                      "past it, 413."),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config",
        help="Default JSON for apply_chat_template; a request's chat_template_kwargs override it. "
        "With a drafter, thinking is off unless set here or in the request."),
    allow_request_templates: bool = typer.Option(
        False, "--allow-request-templates",
        help="Let requests send their own Jinja chat template (chat_template_kwargs.chat_template). Off: "
        "such a request gets a 400, since a template runs on the server and can take any memory or time."),
    max_prompt_chars: Optional[int] = typer.Option(
        None, "--max-prompt-chars", help="Most characters of prompt text per request, checked before "
        "tokenizing (default: 8 per token of the target's context); past it, 400."),
    request_timeout: float = typer.Option(
        600.0, "--request-timeout", help="Seconds from a request's arrival (queue wait included) after which "
        "its generation stops and it gets a 408; 0: no limit."),
    idle_timeout: float = typer.Option(5.0, "--idle-timeout", help=IDLE_TIMEOUT_HELP),
    max_connections: int = typer.Option(MAX_CONNECTIONS, "--max-connections", help=MAX_CONNECTIONS_HELP),
    prefill_step_size: Optional[int] = prefill_step_option(),
    prompt_cache_dir: Optional[str] = prompt_cache_dir_option(),
    no_prompt_cache: bool = no_prompt_cache_option(),
    prompt_cache_gb: float = prompt_cache_gb_option(),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    sharding: str = sharding_option(),
) -> None:
    """Serve the pair over the OpenAI API (chat, completions, models, health, metrics).

    Up to --max-batch requests decode together (continuous batching; --block-size
    auto picks one width per step for the batch). Prefixes of earlier prompts are
    kept in the prompt cache (memory and disk, --prompt-cache-dir), so a prompt that
    shares the beginning of an earlier one prefills only the rest (hybrids and
    sliding-window layers at stored states, every 4,096 tokens and before the last).
    Batched requests need a drafter with a batched pass (or none); said in the log.

    Each response's usage has a "dflash" object: tau, steps, acceptance histogram.

    \b
    Examples:
      dflash serve --model ./stories260K --draft-model ./stories260K-drafter
      dflash serve --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16
      DFLASH_API_KEY=secret dflash serve --host 0.0.0.0 --port 8000
      mlx.launch --backend ring -n 2 -- dflash serve --model M --draft-model D
    """
    args = dict(locals())
    guard(lambda: _until_stopped(lambda: _run(**args)))


def _until_stopped(run) -> None:
    """``run()`` with SIGTERM taken as Ctrl-C: while loading, exit 130; once serving,
    both stop the server (:func:`dflash_mlx.serve.lifecycle.serve`)."""
    from dflash_mlx.atomic import sigterm_as_interrupt

    with sigterm_as_interrupt():
        run()


# Over 60 lines: every serve flag is checked here, in order, before the model loads
def _run(model, draft_model, host, port, block_size, recalibrate, max_tokens, api_key, max_queue, max_batch,
         max_body_mb, chat_template_config, allow_request_templates, max_prompt_chars, request_timeout, idle_timeout,
         max_connections, prefill_step_size, prompt_cache_dir, no_prompt_cache, prompt_cache_gb, log_level,
         sharding) -> None:
    from dflash_mlx.errors import InputError
    from dflash_mlx.pair.sharded import join_ranks, rank

    from .common import parse_template_config

    # Flags first, then the imports of the server, mlx-lm and transformers (2-3 s): a bad
    # flag is reported at once.
    if log_level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level}")
    for flag, value, least in (("--max-tokens", max_tokens, 1), ("--max-queue", max_queue, 0),
                               ("--max-prompt-chars", max_prompt_chars, 1), ("--request-timeout", request_timeout, 0)):
        check_number(flag, value, at_least=least)
    check_number("--max-batch", max_batch, at_least=1, at_most=MAX_BATCH)
    check_number("--max-body-mb", max_body_mb, above=0)
    check_number("--idle-timeout", idle_timeout, above=0)
    check_number("--max-connections", max_connections, at_least=2)
    check_number("--port", port, at_least=0, at_most=65535)
    prefill_step_size = resolve_prefill_step(prefill_step_size)
    template = parse_template_config(chat_template_config)
    defaults = model is None and draft_model is None
    model, draft_model = resolve_models(model, draft_model)
    from dflash_mlx.decode.policy import parse_block_size

    block_size = parse_block_size(block_size)
    if block_size not in (None, "auto") and draft_model is None:
        raise InputError("--block-size needs --draft-model (plain decoding has no blocks)")
    from dflash_mlx.serve.lifecycle import listen, serve as serve_on
    distributed = join_ranks(sharding)  # rank 0 serves; the others run its generations (serve/ranks.py)
    max_batch = 1 if distributed else max_batch
    sock = listen(host, port) if rank() == 0 else None  # a port in use is an error now, not after the model loaded
    store = make_store(prompt_cache_dir, no_prompt_cache, prompt_cache_gb) if distributed is None else None

    from dflash_mlx.serve.app import ServerConfig, create_app
    from dflash_mlx.serve.http_protocol import uvicorn_options
    if draft_model is not None:
        template.setdefault("enable_thinking", False)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dflash")
    log.setLevel(log_level.upper())
    pair = load_pair(model, draft_model, defaults, recalibrate=recalibrate, sharding=distributed and sharding)
    config = ServerConfig(model_id=model, max_tokens=max_tokens, block_size=block_size, api_key=api_key,
                          max_queue=max_queue, max_body_bytes=int(max_body_mb * 2**20), template=template,
                          allow_request_templates=allow_request_templates, max_prompt_chars=max_prompt_chars,
                          request_timeout=request_timeout or None, idle_timeout=idle_timeout,
                          prefill_step_size=prefill_step_size, prompt_store=store, max_batch=max_batch)
    app = create_app(pair, config)
    if rank() != 0:
        from dflash_mlx.serve.ranks import follow
        return follow(app.state.server.engine)
    if not api_key and not _is_loopback(host):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", host)
    drafter = f" + {draft_model}" if draft_model else " (no drafter: plain decoding)"
    log.info("serving %s%s on http://%s:%d", model, drafter, host, sock.getsockname()[1])
    serve_on(app, sock, app.state.server.engine, log_level=log_level, **uvicorn_options(idle_timeout, max_connections))
    from dflash_mlx.serve.ranks import send_job
    send_job(None)  # the other ranks stop


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
