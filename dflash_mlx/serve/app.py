# Over 400 lines: one ASGI app: its routes, streams and error mapping read together
"""``dflash serve``: an OpenAI-compatible HTTP server over one target/drafter pair.

FastAPI validates requests (:mod:`dflash_mlx.serve.api`), the :class:`Engine` runs
them one at a time on its worker thread (:mod:`dflash_mlx.serve.engine`), and
``/metrics`` comes from :mod:`dflash_mlx.serve.metrics`. Every error is OpenAI's JSON
error object with a 4xx code (a 500 only for a bug, without the traceback); the
traceback goes to the server's log.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming
with server-sent events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DFlashError
from ..decode.generate import check_block_size
from ..prompt import encode_messages
from .api import (
    TIMEOUT_TYPE, ChatCompletionRequest, CompletionRequest, GenerationFields, chat_chunk, chat_completion,
    error_body, text_completion, usage_chunk,
)
from .jobs import GenerationJob, Job, JobCancelled, QueueFullError, RequestTimeout
from .guard import (
    APIError, GuardMiddleware, body_timeout, check_prompt_chars, check_template_kwargs, count_chars,
    prompt_char_cap, timed_out, too_large, validation_message, watch_disconnect,
)
from .engine import make_engine
from .metrics import ServerMetrics
from .tools import ReplySplitter, check_tool_support, reply_splitter
from ..chat.session import context_length

log = logging.getLogger("dflash.serve")

MAX_BODY_BYTES = 4 * 1024 * 1024
NO_CONTEXT_LIMIT = 1 << 20  # most max_tokens when the model does not state its context
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass
class ServerConfig:
    """How ``dflash serve`` runs.

    Attributes:
        model_id: the name ``/v1/models`` lists; requests must name it (or its
            folder's base name).
        max_tokens: tokens per request when it does not say (``--max-tokens``).
        block_size: B for every request (None: the drafter's trained size; "auto":
            widths by measured cost, except seeded sampled requests, see Engine).
        api_key: when set, every endpoint but ``/health`` needs
            ``Authorization: Bearer <api_key>``.
        max_queue: most requests waiting behind the running one; past it, 429.
        max_body_bytes: largest request body; past it, 413.
        template: default ``apply_chat_template`` keyword arguments; a request's
            ``chat_template_kwargs`` override them.
        allow_request_templates: let a request send its own Jinja chat template
            (``chat_template_kwargs.chat_template``); off, such a request is a 400.
        max_prompt_chars: most characters of prompt text per request, checked before
            tokenizing (None: 8 per token of the target's context, see
            ``server_guard.CHARS_PER_TOKEN``).
        request_timeout: seconds from a request's arrival at the engine after which
            its generation stops and it gets a 408 (None: no limit).
        idle_timeout: seconds a connection may stay idle between requests, and a
            request body between its chunks (408).
        prefill_step_size: prompt tokens per prefill chunk (None: generate's
            default); an abandoned request stops between two chunks.
        prompt_store: the prompt cache (:class:`dflash_mlx.prefix.store.PrefixStore`):
            requests also resume from prefixes kept there, in memory and on disk
            (None: from the previous request's caches only). The batching engine uses it
            where both caches are plain attention KV caches and the drafter has a
            batched pass (else it says why in the log, once).
        max_batch: most requests decoding together (``--max-batch``); 1 runs them one
            at a time (:class:`Engine`), more batches them
            (:class:`~dflash_mlx.serve.batch_engine.BatchEngine`) where the target allows.
    """

    model_id: str
    max_tokens: int = 512
    block_size: Optional[int] = None
    api_key: Optional[str] = None
    max_queue: int = 16
    max_body_bytes: int = MAX_BODY_BYTES
    template: Dict[str, Any] = field(default_factory=dict)
    allow_request_templates: bool = False
    max_prompt_chars: Optional[int] = None
    request_timeout: Optional[float] = 600.0
    idle_timeout: float = 5.0
    prefill_step_size: Optional[int] = None
    prompt_store: Optional[Any] = None
    max_batch: int = 1


class Server:
    """The routes' logic over one loaded pair; :func:`create_app` wires it to FastAPI.

    Args:
        pair: the loaded :class:`dflash_mlx.Pair`.
        config: see :class:`ServerConfig`.

    Raises:
        InputError: ``config.block_size`` out of range for the drafter.
    """

    def __init__(self, pair: Any, config: ServerConfig):
        self.pair, self.config = pair, config
        self.tokenizer = pair.tokenizer
        trained = pair.drafter.block_size if pair.drafter is not None else 1
        check_block_size(config.block_size, pair.drafter)
        self.metrics = ServerMetrics(trained)
        self.engine = make_engine(pair, config.max_batch, self.metrics, block_size=config.block_size,
                                  max_queue=config.max_queue, prefill_step_size=config.prefill_step_size,
                                  store=config.prompt_store)
        self.context = context_length(pair.model)
        self.char_cap = prompt_char_cap(self.context, config.max_prompt_chars)
        self.names = {config.model_id, PurePath(config.model_id).name, real_path(config.model_id)}
        self.created = int(time.time())
        self.tool_warnings: set = set()  # what check_tool_support logged once

    # -- requests to prompt ids ---------------------------------------------------

    def check_model(self, name: str) -> None:
        """The request's ``model``: the served name, its folder's base name, or any
        spelling of the same folder (relative, ``~``, a trailing slash, a link).

        Raises:
            APIError: 404 ``model_not_found`` for anything else.
        """
        if name not in self.names and real_path(name) not in self.names:
            raise APIError(404, f"model: '{name}' is not served here; this server serves "
                                f"'{self.config.model_id}' (see GET /v1/models)", "model", "model_not_found")

    def check_chat(self, req: ChatCompletionRequest) -> None:
        """The checks of a chat request that need no tokenizer (in the handler)."""
        check_template_kwargs(req.chat_template_kwargs, self.config.allow_request_templates)
        check_tool_support(self.tokenizer, bool(req.tools), req.tool_choice, self.tool_warnings)
        n = count_chars([m.for_template() for m in req.messages]) + count_chars(req.template_tools())
        check_prompt_chars(n, self.char_cap, "messages", self.context)

    def check_completion(self, req: CompletionRequest) -> None:
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            return  # token ids: counted against the context, no tokenizing
        check_prompt_chars(count_chars(req.prompt), self.char_cap, "prompt", self.context)

    def encode_chat(self, req: ChatCompletionRequest) -> List[int]:
        return chat_prompt_ids(self.tokenizer, req, self.config.template)

    def encode_prompt(self, req: CompletionRequest) -> List[int]:
        """Prompt ids of a completions request: the text with the tokenizer's special
        tokens (BOS), as ``dflash generate --ignore-chat-template``, or the ids given."""
        try:
            prompt = req.prompt_value()
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt: the prompt is empty", "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        vocab = self.pair.target.vocab_size
        if not prompt or not all(0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt: token ids must be a non-empty list of ids in 0..{vocab - 1}", "prompt")
        return list(prompt)

    def job(self, req: GenerationFields, ids: List[int], endpoint: str) -> GenerationJob:
        """Check the prompt and ``max_tokens`` against the context; the engine's job.

        A ``max_tokens`` the request sets must fit in the context with the prompt (else
        400 naming both, as OpenAI answers); the server's default (``--max-tokens``) is
        capped to the context left (the reply then ends with ``finish_reason`` "length").
        """
        limit = self.context
        where = "messages" if endpoint == "chat" else "prompt"
        if limit is not None and len(ids) >= limit:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens and the model's context is "
                                f"{limit} tokens", where, "context_length_exceeded")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        n = req.requested_max_tokens()
        if n is not None and limit is not None and len(ids) + n > limit:
            raise APIError(400, f"{param}: the prompt is {len(ids)} tokens and {param} is {n}, past the model's "
                                f"context of {limit} tokens", param, "context_length_exceeded")
        if n is not None and n > (limit or NO_CONTEXT_LIMIT):
            raise APIError(400, f"{param}: {n} is more than the {NO_CONTEXT_LIMIT} tokens this server allows", param)
        n = self.config.max_tokens if n is None else n
        if limit is not None:
            n = min(n, limit - len(ids))
        return GenerationJob(
            ids=ids, max_tokens=n, stop=req.stop_strings(), endpoint=endpoint,
            temperature=req.temperature or 0.0, top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=req.seed,
        )

    # -- responses ----------------------------------------------------------------

    async def respond(self, request: Request, req: GenerationFields, encode, endpoint: str) -> Response:
        """Queue the request (its prompt is tokenized by the engine's worker, in the
        queue's bound), then a JSON body or a stream of server-sent events. The job is
        closed when the client disconnects, before the stream starts or while a
        non-streaming reply is generated (starlette watches a stream itself).

        Args:
            encode: ``encode(req)``, the prompt ids (run on the engine's worker).

        Raises:
            APIError: 429 (queue full), 408 (past ``--request-timeout``), or the 4xx
                the prompt's checks raise.
        """
        try:
            job = self.engine.submit(lambda: self.job(req, encode(req), endpoint), endpoint,
                                     self.config.request_timeout)
        except QueueFullError as e:
            raise APIError(429, str(e), code="rate_limit_exceeded") from None
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, job))
        streaming = False  # once the stream is handed over, it closes the job and the watcher
        try:
            try:
                spec = await job.start()
            except JobCancelled:
                return self.unfinished()
            except QueueFullError:
                raise shutting_down() from None
            except RequestTimeout as e:
                raise timed_out(str(e), counted=True) from None
            rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
            split = reply_splitter(self.tokenizer, req, spec.ids) if endpoint == "chat" else None
            if req.stream:  # the watcher stays: starlette may cancel the stream before it starts
                events = self._events(job, rid, req.model, endpoint, req.include_usage(), watcher, split)
                streaming = True
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            text, finish, usage_ = [], None, None
            async for c in job:
                if c.error:
                    if c.status == 408:
                        raise timed_out(c.error, counted=True)
                    raise APIError(500, c.error, type_="server_error", counted=True)
                text.append(c.text)
                finish, usage_ = c.finish_reason or finish, c.usage or usage_
        finally:
            if not streaming:
                watcher.cancel()
                job.close()
        if finish is None:
            return self.unfinished()
        if endpoint == "chat":
            message, finish = split.whole("".join(text), finish)
            return JSONResponse(chat_completion(rid, req.model, message, finish, usage_))
        return JSONResponse(text_completion(rid, req.model, "".join(text), finish, usage_))

    async def _events(self, job: Job, rid: str, model: str, endpoint: str, include_usage: bool,
                      watcher: asyncio.Future, split: Optional[ReplySplitter] = None) -> AsyncIterator[str]:
        """Server-sent events: deltas (a chat's split by ``split``), the finish chunk,
        the usage chunk if asked, then ``[DONE]``. Leaving early (the client went
        away) stops the generation; ``watcher`` (the disconnect watch) is cancelled
        at the end."""
        chat, finished = endpoint == "chat", False
        try:
            if chat:
                yield _sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            async for c in job:
                finished = finished or bool(c.error or c.finish_reason)
                if c.error:
                    yield _sse(error_body(c.error, "server_error") if c.status != 408
                               else error_body(c.error, TIMEOUT_TYPE, code="request_timeout"))
                    break
                delta = split.chunk(c.text, c.finish_reason) if chat else {}
                if delta or (c.text and not chat):
                    yield _sse(chat_chunk(rid, model, delta) if chat
                               else text_completion(rid, model, c.text, None, chunk=True))
                if c.finish_reason:
                    yield _sse(chat_chunk(rid, model, {}, split.finish_reason(c.finish_reason)) if chat
                               else text_completion(rid, model, "", c.finish_reason, chunk=True))
                    if include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        yield _sse(usage_chunk(rid, model, obj, c.usage))
            if not finished and self.engine.closing:  # stopped by the shutdown, not by the client
                yield _sse(error_body(shutting_down().message, "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            job.close()

    def unfinished(self) -> Response:
        """The answer to a job that ended without finishing: stopped by the shutdown
        (503), else its client went away (499, which nobody reads).

        Raises:
            APIError: 503 when the server is shutting down.
        """
        if self.engine.closing:
            raise shutting_down()
        return gone()

    def models(self) -> Dict[str, Any]:
        pair = self.pair
        card = {"id": self.config.model_id, "object": "model", "created": self.created,
                "owned_by": "dflash-mlx",
                "dflash": {"draft_model": pair.draft_path,
                           "block_size": check_block_size(self.config.block_size, pair.drafter),
                           "context_length": self.context}}
        return {"object": "list", "data": [card]}


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, defaults: Dict[str, Any]) -> List[int]:
    """Prompt ids of a chat request: the tokenizer's chat template, given ``tools`` and
    ``chat_template_kwargs`` (over the server's ``defaults``), or for a model without
    one the messages' text joined, as ``dflash generate`` and ``chat`` do.

    Raises:
        APIError: 400 when the template cannot render the messages.
    """
    messages = [m.for_template() for m in req.messages]
    template = {**defaults, **(req.chat_template_kwargs or {})}
    if req.tools:
        template["tools"] = req.template_tools()
    try:
        return encode_messages(tokenizer, messages, template)
    except Exception as e:  # jinja2 and template errors of any kind: the request is at fault
        raise APIError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                       "messages") from None


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type_="server_error", counted=True)


def gone() -> Response:
    """The answer to a client that went away (nobody reads it; nginx's 499)."""
    return Response(status_code=499)


def _sse(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def real_path(name: str) -> Optional[str]:
    """``name`` as a path with ``~``, links, ``.`` and ``..`` resolved; None when it cannot be one."""
    try:
        return os.path.realpath(os.path.expanduser(name))
    except (ValueError, OSError):  # a NUL byte, a name too long
        return None


# Over 60 lines: the routes, read together; split after the hardening work lands
def create_app(pair: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``pair``; run it with uvicorn (``dflash serve`` does).

    Raises:
        InputError: ``config.block_size`` out of range for the drafter.
    """
    server = Server(pair, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(server.engine.shutdown, True)  # the worker ends before the app

    app = FastAPI(title="dflash-mlx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       idle_timeout=config.idle_timeout)

    def count_refusal(request: Request, status: int) -> None:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            server.metrics.request(endpoint, "rejected" if status == 429 else "invalid")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if not exc.counted:
            count_refusal(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return await api_error(request, too_large(config.max_body_bytes))
        if exc.status_code == 408:
            return await api_error(request, body_timeout(config.idle_timeout))
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

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(req.model)
        server.check_chat(req)
        return await server.respond(request, req, server.encode_chat, "chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        server.check_model(req.model)
        server.check_completion(req)
        return await server.respond(request, req, server.encode_prompt, "completions")

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Dict[str, Union[str, int]]:
        out: Dict[str, Union[str, int]] = {"status": "ok", "model": config.model_id, "queue": server.engine.pending}
        if config.prompt_store is not None:  # "disk (ROOT)", or "memory-only (why)" after a failed write
            out["prompt_cache"] = config.prompt_store.state
        return out

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
