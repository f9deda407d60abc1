"""``dflash serve``: an OpenAI-compatible HTTP server over one pair: ``POST /v1/chat/completions``,
``POST /v1/completions`` (JSON or server-sent events), ``GET /v1/models``, ``/health``, ``/metrics``."""

import asyncio
import json
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Dict, List, Optional, Type, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..decode.generate import check_block_size
from ..prompt import context_length, encode_messages
from .api import ChatCompletionRequest, CompletionRequest, GenerationFields
from .engine import Engine
from .jobs import GenerationJob
from .guard import GuardMiddleware, check_prompt_chars, check_template_kwargs, prompt_char_cap
from .http_errors import APIError, add_error_handlers, validation_message
from .metrics import ServerMetrics
from .replies import respond
from .tool_requests import count_chars
from .tools import check_tool_support

MAX_BODY_BYTES = 4 * 1024 * 1024
NO_CONTEXT_LIMIT = 1 << 20  # most max_tokens when the model does not state its context


@dataclass
class ServerConfig:
    """How ``dflash serve`` runs (the ``serve`` flags of the same names)."""

    model_id: str  # the name /v1/models lists; requests name it, its folder's base name or the folder
    max_tokens: int = 512  # when a request does not say
    block_size: Optional[int] = None  # None: the drafter's trained size; "auto"
    prompt_lookup: bool = False  # drafts copied from the context (one request at a time)
    api_key: Optional[str] = None  # every endpoint but /health then needs "Authorization: Bearer KEY" (401)
    max_queue: int = 16  # most requests waiting (429)
    max_body_bytes: int = MAX_BODY_BYTES  # 413
    template: Dict[str, Any] = field(default_factory=dict)  # apply_chat_template defaults (chat_template_kwargs)
    allow_request_templates: bool = False  # a request may send its own chat_template
    max_prompt_chars: Optional[int] = None  # None: CHARS_PER_TOKEN per token of context
    request_timeout: Optional[float] = 600.0  # seconds from arrival (408)
    idle_timeout: float = 5.0  # seconds a connection or a body between chunks may idle (408)
    prefill_step_size: Optional[int] = None
    prompt_store: Optional[Any] = None  # a PrefixStore to resume from (None: the last request's caches)
    max_batch: int = 1
    distributed: Optional[dict] = None  # under mlx.launch: {"ranks", "sharding", "max_batch"} (/health)


class Server:
    """The requests' checks and prompts over one loaded pair; InputError: ``config.block_size`` out of range."""

    def __init__(self, pair: Any, config: ServerConfig):
        self.pair, self.config = pair, config
        self.tokenizer = pair.tokenizer
        trained = pair.drafter.block_size if pair.drafter is not None else 1
        self.metrics = ServerMetrics(trained)
        self.engine = Engine(pair, max_batch=config.max_batch, metrics=self.metrics, block_size=config.block_size,
                             max_queue=config.max_queue, prefill_step_size=config.prefill_step_size,
                             store=config.prompt_store, prompt_lookup=config.prompt_lookup)
        self.context = context_length(pair.model)
        self.char_cap = prompt_char_cap(self.context, config.max_prompt_chars)
        self.names = {config.model_id, PurePath(config.model_id).name, real_path(config.model_id)}
        self.created = int(time.time())
        self.tool_warnings: set = set()  # what check_tool_support logged once

    def check_model(self, req: GenerationFields) -> None:
        """Sets ``req.model`` to the served model's id when the request names none (as ``mlx_lm.server``); raises
        APIError 404 ``model_not_found`` unless it names the served model (or its folder)."""
        name = req.model
        if name is None:
            req.model = self.config.model_id
        elif name not in self.names and real_path(name) not in self.names:
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

    def encode_prompt(self, req: CompletionRequest) -> List[int]:
        """Prompt ids of a completions request: the text with special tokens (BOS), or the ids given."""
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
        """The engine's job; 400 ``context_length_exceeded`` when the prompt and a requested ``max_tokens`` do not
        fit the context (the default ``max_tokens`` is capped to it)."""
        limit = self.context
        where = "messages" if endpoint == "chat" else "prompt"
        if limit is not None and len(ids) >= limit:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens and the model's context is "
                                f"{limit} tokens", where, "context_length_exceeded")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        n = getattr(req, param)
        if n is not None and limit is not None and len(ids) + n > limit:
            raise APIError(400, f"{param}: the prompt is {len(ids)} tokens and {param} is {n}, past the model's "
                                f"context of {limit} tokens", param, "context_length_exceeded")
        if n is not None and n > (limit or NO_CONTEXT_LIMIT):
            raise APIError(400, f"{param}: {n} is more than the {NO_CONTEXT_LIMIT} tokens this server allows", param)
        n = self.config.max_tokens if n is None else n
        if limit is not None:
            n = min(n, limit - len(ids))
        return GenerationJob(ids=ids, max_tokens=n, stop=req.stop_strings(), endpoint=endpoint,
                             temperature=req.temperature or 0.0, top_p=1.0 if req.top_p is None else req.top_p,
                             top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=req.seed)

    def models(self) -> Dict[str, Any]:
        pair = self.pair
        block_size = check_block_size(self.config.block_size, pair.drafter)
        card = {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "dflash-mlx",
                "dflash": {"draft_model": pair.draft_path, "block_size": block_size, "context_length": self.context}}
        return {"object": "list", "data": [card]}


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, defaults: Dict[str, Any]) -> List[int]:
    """Prompt ids of a chat request: the chat template with ``tools`` and ``chat_template_kwargs`` (over ``defaults``),
    or the messages' text joined for a model without one; APIError 400 when the template cannot render the messages."""
    messages = [m.for_template() for m in req.messages]
    template = {**defaults, **(req.chat_template_kwargs or {})}
    if req.tools:
        template["tools"] = req.template_tools()
    try:
        return encode_messages(tokenizer, messages, template)
    except Exception as e:  # jinja2 and template errors of any kind: the request is at fault
        raise APIError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                       "messages") from None


Body = TypeVar("Body", bound=BaseModel)


async def read_request(request: Request, model: Type[Body]) -> Body:
    """The body as JSON whatever its Content-Type (``curl -d`` sends form-urlencoded), as ``mlx_lm.server`` reads it;
    APIError 400 for a body that is not a JSON object or does not validate as ``model``."""
    body = await request.body()
    try:
        data = json.loads(body) if body.strip() else None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg} at character {e.pos})") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid JSON (not UTF-8)") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_message(e.errors()) from None


def real_path(name: str) -> Optional[str]:
    """``name`` as a resolved path; None when it cannot be one."""
    try:
        return os.path.realpath(os.path.expanduser(name))
    except (ValueError, OSError):  # a NUL byte, a name too long
        return None


def create_app(pair: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``pair`` (run with uvicorn); InputError: ``config.block_size`` out of range."""
    server = Server(pair, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(server.engine.shutdown, True)  # the worker ends before the app

    app = FastAPI(title="dflash-mlx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       idle_timeout=config.idle_timeout)
    add_error_handlers(app, server.metrics, config.max_body_bytes, config.idle_timeout)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_request(request, ChatCompletionRequest)
        server.check_model(req)
        server.check_chat(req)
        return await respond(server, request, req, lambda r: chat_prompt_ids(server.tokenizer, r, config.template),
                             "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await read_request(request, CompletionRequest)
        server.check_model(req)
        server.check_completion(req)
        return await respond(server, request, req, server.encode_prompt, "completions")

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Dict[str, Any]:
        out: Dict[str, Any] = {"status": "ok", "model": config.model_id, "queue": server.engine.pending}
        if config.prompt_store is not None:  # "disk (ROOT)", or "memory-only (why)" after a failed write
            out["prompt_cache"] = config.prompt_store.state
        if config.distributed is not None:
            out["distributed"] = config.distributed
        return out

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
