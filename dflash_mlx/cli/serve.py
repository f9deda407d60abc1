"""``dflash serve``: the OpenAI-compatible server (wiring over :mod:`dflash_mlx.serve.app`)."""

import ipaddress
import logging
from types import SimpleNamespace
from typing import Annotated, Optional

from typer import Option

from dflash_mlx.errors import InputError
from dflash_mlx.ranges import check_number

from .common import (BlockSize, DraftModel, Model, NoPromptCache, PrefillStep, PromptCacheDir, PromptCacheGb,
                     PromptLookup, Sharding, check_pair_flags, check_template_flags, guard, load_pair)

LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_BATCH = 256  # a batch's cache grows with it: a typo (8000) should not take the memory
MAX_CONNECTIONS = 128  # well under macOS's default of 256 open files per process


def serve(
    model: Model = None, draft_model: DraftModel = None,
    host: Annotated[str, Option("--host", help="Address to bind; beyond this Mac, use --api-key.")] = "127.0.0.1",
    port: Annotated[int, Option("--port", help="TCP port.")] = 8080,
    block_size: BlockSize = "auto", prompt_lookup: PromptLookup = "auto",
    max_tokens: Annotated[int, Option("--max-tokens", "-m", help="Tokens per request that does not say.")] = 512,
    api_key: Annotated[Optional[str], Option("--api-key", envvar="DFLASH_API_KEY", help=(
        "Require 'Authorization: Bearer KEY' on every endpoint but /health."))] = None,
    max_queue: Annotated[int, Option("--max-queue", help="Requests waiting behind running ones; then 429.")] = 16,
    max_batch: Annotated[int, Option("--max-batch", help="Requests decoding together; 1: one at a time.")] = 8,
    max_body_mb: Annotated[float, Option("--max-body-mb", help="Largest request body in MB; past it, 413.")] = 4.0,
    chat_template_config: Annotated[Optional[str], Option("--chat-template-config", help=(
        "Default JSON for apply_chat_template; a request's chat_template_kwargs override it."))] = None,
    allow_request_templates: Annotated[bool, Option("--allow-request-templates", help=(
        "Let requests send their own Jinja chat template (else 400: it runs on the server)."))] = False,
    max_prompt_chars: Annotated[Optional[int], Option("--max-prompt-chars", help=(
        "Most prompt characters per request (default: 8 per context token); past it, 400."))] = None,
    request_timeout: Annotated[float, Option("--request-timeout", help=(
        "Seconds from a request's arrival after which it stops with a 408; 0: no limit."))] = 600.0,
    idle_timeout: Annotated[float, Option("--idle-timeout", help=(
        "Seconds a connection may idle, its headers take, or its body stall (then 408)."))] = 5.0,
    max_connections: Annotated[int, Option("--max-connections", help="Open connections; then 503.")] = MAX_CONNECTIONS,
    prefill_step_size: PrefillStep = None, prompt_cache_dir: PromptCacheDir = None,
    no_prompt_cache: NoPromptCache = False, prompt_cache_gb: PromptCacheGb = 8.0,
    log_level: Annotated[str, Option("--log-level", help="debug, info, warning or error.")] = "info",
    sharding: Sharding = None,
) -> None:
    """Serve the pair over the OpenAI API (chat, completions, models, health, metrics).

    A prompt sharing an earlier one's beginning prefills only the rest. Each usage has a "dflash" object.

    \b
    Examples:
      dflash serve --model ./stories260K --draft-model ./stories260K-drafter
      dflash serve --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16
      DFLASH_API_KEY=secret dflash serve --host 0.0.0.0 --port 8000
      mlx.launch --backend ring -n 2 -- dflash serve --model M --draft-model D
    """
    from dflash_mlx.atomic import sigterm_as_interrupt

    o = SimpleNamespace(**locals())
    with sigterm_as_interrupt():  # exit 130 while loading; once serving, it stops the server
        guard(lambda: _run(o))


def _run(o) -> None:
    if o.log_level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {o.log_level}")
    for flag, value, least in (("--max-tokens", o.max_tokens, 1), ("--max-queue", o.max_queue, 0),
                               ("--max-prompt-chars", o.max_prompt_chars, 1),
                               ("--request-timeout", o.request_timeout, 0),
                               ("--max-connections", o.max_connections, 2)):
        check_number(flag, value, at_least=least)
    check_number("--max-batch", o.max_batch, at_least=1, at_most=MAX_BATCH)
    check_number("--max-body-mb", o.max_body_mb, above=0)
    check_number("--idle-timeout", o.idle_timeout, above=0)
    check_number("--port", o.port, at_least=0, at_most=65535)
    check_pair_flags(o)  # every flag checked before the model loads
    from dflash_mlx.pair.sharded import join_ranks, rank

    distributed = join_ranks(o.sharding)
    if distributed is not None:  # one request at a time, no prompt cache on disk (the engine says so)
        o.store, distributed["max_batch"] = None, 1
    from dflash_mlx.serve.lifecycle import listen, serve as serve_on

    sock = listen(o.host, o.port) if rank() == 0 else None  # a port in use is an error now, not after loading
    from dflash_mlx.serve.app import ServerConfig, create_app
    from dflash_mlx.serve.http_protocol import uvicorn_options

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dflash")
    log.setLevel(o.log_level.upper())
    pair = load_pair(o.model, o.draft_model, o.defaults, None, distributed and distributed["sharding"])
    check_template_flags(pair.tokenizer, template_config=o.chat_template_config)
    if sock is None:
        from dflash_mlx.serve.engine import follow

        return follow(pair, o.block_size, o.prefill_step_size, o.prompt_lookup == "auto")
    config = ServerConfig(model_id=o.model, max_tokens=o.max_tokens, block_size=o.block_size, api_key=o.api_key,
                          prompt_lookup=o.prompt_lookup == "auto",
                          max_queue=o.max_queue, max_body_bytes=int(o.max_body_mb * 2**20), template=o.template,
                          allow_request_templates=o.allow_request_templates, max_prompt_chars=o.max_prompt_chars,
                          request_timeout=o.request_timeout or None, idle_timeout=o.idle_timeout,
                          prefill_step_size=o.prefill_step_size, prompt_store=o.store, max_batch=o.max_batch,
                          distributed=distributed)
    app = create_app(pair, config)
    if not o.api_key and not _is_loopback(o.host):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", o.host)
    drafter = f" + {o.draft_model}" if o.draft_model else " (no drafter: plain decoding)"
    log.info("serving %s%s on http://%s:%d", o.model, drafter, o.host, sock.getsockname()[1])
    serve_on(app, sock, app.state.server.engine, log_level=o.log_level,
             **uvicorn_options(o.idle_timeout, o.max_connections))


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
