"""Errors as OpenAI's JSON error object: :class:`APIError` and the app's exception handlers."""

import logging
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DFlashError
from ..prompt_cache.pair import common_prefix
from .api import REQUEST_ERROR, TIMEOUT_TYPE, error_body

log = logging.getLogger("dflash.serve")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error object (``param``: the field at fault; ``counted``: the
    engine has counted the request in the metrics already)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error", headers: Optional[Dict[str, str]] = None, counted: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers, self.counted = headers, counted

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def too_large(cap: int) -> APIError:
    return APIError(413, f"the request body is larger than {cap} bytes (--max-body-mb)", code="request_too_large")


def timed_out(message: str, counted: bool = False) -> APIError:
    """A 408, typed ``timeout`` (the request was well formed; time ran out)."""
    return APIError(408, message, code="request_timeout", type_=TIMEOUT_TYPE, counted=counted)


def add_error_handlers(app: FastAPI, metrics, max_body_bytes: int, idle_timeout: float) -> None:
    """Answer every error with OpenAI's error object (a 500's traceback goes to the log); count refusals."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        endpoint = ENDPOINTS.get(request.url.path)
        if not exc.counted and endpoint is not None:
            metrics.request(endpoint, "rejected" if exc.status in (429, 503) else "invalid")
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return await api_error(request, too_large(max_body_bytes))
        if exc.status_code == 408:
            return await api_error(request, timed_out(f"the request body stalled for more than {idle_timeout:g} s "
                                                      "(--idle-timeout)"))
        messages = {404: f"no route {request.method} {request.url.path}",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        return await api_error(request, APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(DFlashError)
    async def dflash_error(request: Request, exc: DFlashError):
        return await api_error(request, APIError(400, str(exc)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__}); see the server log",
                        type_="server_error").response()


def validation_message(errors: List[Dict[str, Any]]) -> APIError:
    """The first field's validation errors (pydantic's) as one 400 naming the field (a union's: each member's
    message)."""
    err = errors[0]
    own = next((e for e in errors if e.get("type") == REQUEST_ERROR), None)
    if own is not None:
        return APIError(400, own["msg"], own["ctx"]["param"])
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    same = [i for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]]
    param = locs[0]
    for i in same:
        param = param[:common_prefix(param, locs[i])]
    if not param and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    messages = list(dict.fromkeys(errors[i].get("msg", "invalid") for i in same))
    name = ".".join(param) or None
    return APIError(400, f"{name or 'body'}: {' or '.join(messages)}", name)
