"""``dflash serve``: the OpenAI-compatible server (wiring over :mod:`dflash_mlx.serve.app`)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Optional

import typer

from .common import (block_size_option, draft_model_option, guard, load_pair, model_option, recalibrate_option,
                     resolve_models)

LOG_LEVELS = ("debug", "info", "warning", "error")


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
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait behind the running one; "
                                  "past that, 429."),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", help="Largest request body, in MB (2^20 bytes); "
                                      "past it, 413."),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config",
        help="Default JSON for apply_chat_template; a request's chat_template_kwargs override it. "
        "With a drafter, thinking is off unless set here or in the request."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Serve the pair over the OpenAI API (chat, completions, models, health, metrics).

    Requests run one at a time; both caches are kept between them, so a prompt
    that continues the last one prefills only its new tokens.

    Each response's usage has a "dflash" object: tau, steps, acceptance histogram.

    \b
    Examples:
      dflash serve --model ./stories260K --draft-model ./stories260K-drafter
      dflash serve --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16
      DFLASH_API_KEY=secret dflash serve --host 0.0.0.0 --port 8000
    """
    args = dict(locals())
    guard(lambda: _run(**args))


def _run(model, draft_model, host, port, block_size, recalibrate, max_tokens, api_key, max_queue, max_body_mb,
         chat_template_config, log_level) -> None:
    import uvicorn

    from dflash_mlx import InputError
    from dflash_mlx.serve.app import ServerConfig, create_app

    from .common import parse_template_config

    if log_level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level}")
    if max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {max_tokens}")
    if max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {max_queue}")
    if max_body_mb <= 0:
        raise InputError(f"--max-body-mb must be > 0, got {max_body_mb}")
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {port}")
    template = parse_template_config(chat_template_config)
    defaults = model is None and draft_model is None
    model, draft_model = resolve_models(model, draft_model)
    from dflash_mlx.decode.policy import parse_block_size

    block_size = parse_block_size(block_size)
    if block_size not in (None, "auto") and draft_model is None:
        raise InputError("--block-size needs --draft-model (plain decoding has no blocks)")
    if draft_model is not None:
        template.setdefault("enable_thinking", False)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dflash")
    log.setLevel(log_level.upper())
    pair = load_pair(model, draft_model, defaults, recalibrate=recalibrate)
    config = ServerConfig(model_id=model, max_tokens=max_tokens, block_size=block_size, api_key=api_key,
                          max_queue=max_queue, max_body_bytes=int(max_body_mb * 2**20), template=template)
    app = create_app(pair, config)
    if not api_key and not _is_loopback(host):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", host)
    drafter = f" + {draft_model}" if draft_model else " (no drafter: plain decoding)"
    log.info("serving %s%s on http://%s:%d", model, drafter, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
