"""What bounds a request before the engine: API key, body size and idle time, template arguments, prompt size."""

import asyncio
import hmac
import logging
from typing import Any, Dict, Optional

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .http_errors import APIError, too_large

log = logging.getLogger("dflash.serve")

CHARS_PER_TOKEN = 8  # the default prompt cap, in characters per token of context

# apply_chat_template arguments the server sets itself; the other chat_template_kwargs are the template's variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
TEMPLATE_KWARGS = ("chat_template",)  # a template's source: only with --allow-request-templates


class GuardMiddleware:
    """ASGI middleware: 401 without the ``api_key`` (not on ``/health``), 413 for a body past ``max_body_bytes``
    (declared or counted), 408 for a body idle more than ``idle_timeout`` seconds between chunks."""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int, idle_timeout: Optional[float] = None):
        self.app, self.max_body_bytes, self.idle_timeout = app, max_body_bytes, idle_timeout
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            if (err := self._check(Headers(scope=scope), scope["path"])) is not None:
                return await err.response()(scope, receive, send)
            receive = self._counted(receive)
        await self.app(scope, receive, send)

    def _counted(self, receive):
        seen, more = 0, True

        async def counted():
            nonlocal seen, more
            if more and self.idle_timeout:  # only while the body comes in: later calls wait for a disconnect
                try:
                    message = await asyncio.wait_for(receive(), self.idle_timeout)
                except asyncio.TimeoutError:
                    raise StarletteHTTPException(408) from None
            else:
                message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise StarletteHTTPException(413)  # FastAPI passes it on to our handler
            return message

        return counted

    def _check(self, headers: Headers, path: str) -> Optional[APIError]:
        if self.expected is not None and path != "/health":
            given = headers.get("authorization", "")
            scheme, _, key = given.strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.expected):
                what = "a wrong API key" if given else "no API key"
                return APIError(401, f"{what}: send the server's --api-key as 'Authorization: Bearer KEY'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        return too_large(self.max_body_bytes) if length.isdigit() and int(length) > self.max_body_bytes else None


def check_template_kwargs(kwargs: Optional[Dict[str, Any]], allow_templates: bool) -> None:
    """Raises APIError 400 naming ``chat_template_kwargs.KEY`` for a template source without ``allow_templates``,
    or an argument the server sets itself."""
    for key in kwargs or {}:
        param = f"chat_template_kwargs.{key}"
        if key in TEMPLATE_KWARGS and not allow_templates:
            raise APIError(400, f"{param}: this server does not run chat templates sent in requests "
                                "(start it with --allow-request-templates to allow them)", param)
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = " (send tools in the request's tools field)" if key == "tools" else ""
            raise APIError(400, f"{param}: set by the server, not by a request{hint}", param)


def prompt_char_cap(context: Optional[int], max_prompt_chars: Optional[int]) -> Optional[int]:
    """Most prompt characters: ``max_prompt_chars``, else :data:`CHARS_PER_TOKEN` per token of context (or None)."""
    return max_prompt_chars if max_prompt_chars is not None else None if context is None else CHARS_PER_TOKEN * context


def check_prompt_chars(n: int, cap: Optional[int], param: str, context: Optional[int]) -> None:
    """Raises APIError 400 ``context_length_exceeded`` naming ``param`` for ``n`` characters past ``cap``."""
    if cap is not None and n > cap:
        per = f" ({CHARS_PER_TOKEN} per token of the model's {context}-token context)" if context else ""
        raise APIError(400, f"{param}: the prompt is {n} characters; this server takes at most {cap}{per}, "
                            "see --max-prompt-chars", param, "context_length_exceeded")


async def watch_disconnect(receive, job) -> None:
    """Close ``job`` when the client disconnects (a task from when the body is read to the response's end)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.close()
            log.info("request %s: the client went away; it stops after its current step", job.id)
            return
