"""What bounds a request's work in ``dflash serve``, before it reaches the engine.

- :class:`GuardMiddleware`: the API key, the body cap (413) and the body's idle
  timeout (408), before the body is parsed.
- :func:`check_template_kwargs`: a request may pass variables to the server's chat
  template, never a template of its own (a client's Jinja would run on the server:
  one line can ask for gigabytes) unless ``--allow-request-templates``.
- :func:`check_prompt_chars`: the prompt's length in characters against a cap derived
  from the context, before anything is tokenized.
- :func:`watch_disconnect`: closes the job when the client goes away, streaming or not.
- :func:`validation_message`: pydantic's errors as one 400 line naming the field.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Dict, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import REQUEST_ERROR, TIMEOUT_TYPE, error_body

# Default prompt cap: this many characters per token of context. Text averages 3 to 5
# characters per token with current tokenizers, so 8 leaves room; --max-prompt-chars
# sets another cap.
CHARS_PER_TOKEN = 8

# apply_chat_template arguments the server sets itself (or must not be set by a
# request); the other chat_template_kwargs are variables for the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
TEMPLATE_KWARGS = ("chat_template",)  # a template's source: only with --allow-request-templates


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error object.

    Args:
        status: HTTP status (4xx; 5xx for server faults).
        message: one line naming the field at fault.
        param: the request field, if one is at fault.
        code: OpenAI's error code (e.g. ``context_length_exceeded``), if any.
        type_: OpenAI's error type.
        counted: the engine has counted the request in the metrics already.
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error", headers: Optional[Dict[str, str]] = None,
                 counted: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers, self.counted = headers, counted

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def too_large(cap: int) -> APIError:
    return APIError(413, f"the request body is larger than {cap} bytes (--max-body-mb)",
                    code="request_too_large")


def timed_out(message: str, counted: bool = False) -> APIError:
    """A 408, typed ``timeout`` (the request was well formed; time ran out)."""
    return APIError(408, message, code="request_timeout", type_=TIMEOUT_TYPE, counted=counted)


def body_timeout(seconds: float) -> APIError:
    return timed_out(f"the request body stalled for more than {seconds:g} s (--idle-timeout)")


class GuardMiddleware:
    """Before a request's body is read: refuse it without ``Authorization: Bearer
    <api_key>`` (when a key is set; ``/health`` stays open; the scheme in any case, the
    key compared in constant time),
    or when its declared ``Content-Length`` is past the cap. A body sent without a
    length is counted while it is read, and a body that stalls for more than
    ``idle_timeout`` seconds between chunks is refused with 408. (FastAPI's own
    ``max_body_size`` answers in plain text, not OpenAI's JSON error; uvicorn has no
    body timeout.)"""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int, idle_timeout: Optional[float] = None):
        self.app, self.max_body_bytes, self.idle_timeout = app, max_body_bytes, idle_timeout
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self._check(Headers(scope=scope), scope["path"])
            if err is not None:
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
            if message["type"] == "http.request":
                more = message.get("more_body", False)
            else:
                more = False
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
        if length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None


def check_template_kwargs(kwargs: Optional[Dict[str, Any]], allow_templates: bool) -> None:
    """Refuse ``chat_template_kwargs`` that would change what the server renders.

    Raises:
        APIError: 400 naming ``chat_template_kwargs.KEY`` for a template source
            (``chat_template``) without ``allow_templates``, or an argument the server
            sets itself (``tokenize``, ``tools``, ...).
    """
    for key in kwargs or {}:
        param = f"chat_template_kwargs.{key}"
        if key in TEMPLATE_KWARGS and not allow_templates:
            raise APIError(400, f"{param}: this server does not run chat templates sent in requests "
                                "(start it with --allow-request-templates to allow them)", param)
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = " (send tools in the request's tools field)" if key == "tools" else ""
            raise APIError(400, f"{param}: set by the server, not by a request{hint}", param)


def count_chars(value: Any) -> int:
    """Characters in every string (and dict key) inside ``value``."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + count_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(count_chars(v) for v in value)
    return 0


def prompt_char_cap(context: Optional[int], max_prompt_chars: Optional[int]) -> Optional[int]:
    """The most prompt characters a request may send: ``max_prompt_chars`` if given,
    else :data:`CHARS_PER_TOKEN` per token of ``context`` (None: no cap)."""
    if max_prompt_chars is not None:
        return max_prompt_chars
    return None if context is None else CHARS_PER_TOKEN * context


def check_prompt_chars(n: int, cap: Optional[int], param: str, context: Optional[int]) -> None:
    """Refuse a prompt of ``n`` characters past ``cap``, before it is tokenized.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    if cap is not None and n > cap:
        per = f" ({CHARS_PER_TOKEN} per token of the model's {context}-token context)" if context else ""
        raise APIError(400, f"{param}: the prompt is {n} characters; this server takes at most {cap}{per}, "
                            "see --max-prompt-chars", param, "context_length_exceeded")


async def watch_disconnect(receive, job) -> None:
    """Close ``job`` when the client disconnects. Run as a task once the body is read;
    cancel it when the response is done."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.close()
            return


def validation_message(exc: RequestValidationError) -> APIError:
    """The first field's validation errors as one line naming the field.

    A value that fits no member of a union (``stop``: a string or a list of strings)
    gets one error per member, each with the member's name appended to the field's
    location; the field is their common location, the message each member's message.
    Errors of ``server_api``'s own checks carry their field in their context.
    """
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail} at character {err['loc'][-1]})")
    own = next((e for e in errors if e.get("type") == REQUEST_ERROR), None)
    if own is not None:
        return APIError(400, own["msg"], own["ctx"]["param"])
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    same = [i for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]]
    param = locs[0]
    for i in same:
        n = 0
        while n < min(len(param), len(locs[i])) and param[n] == locs[i][n]:
            n += 1
        param = param[:n]
    if not param and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    messages = list(dict.fromkeys(errors[i].get("msg", "invalid") for i in same))
    name = ".".join(param) or None
    return APIError(400, f"{name or 'body'}: {' or '.join(messages)}", name)
