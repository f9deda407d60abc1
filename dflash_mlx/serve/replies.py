"""A queued request's answer: one JSON body, or server-sent events."""

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Dict, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .api import TIMEOUT_TYPE, chat_chunk, chat_completion, error_body, text_completion, usage_chunk
from .jobs import Job, JobCancelled, QueueFullError, RequestTimeout
from .guard import watch_disconnect
from .http_errors import APIError, timed_out
from .tools import ReplySplitter, reply_splitter

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(server: Any, request: Request, req: Any, encode, endpoint: str) -> Response:
    """Queue the request (``encode(req)``, its prompt ids, runs on the worker), then answer; a disconnect closes it.

    Raises:
        APIError: 429 (queue full), 503 (shutting down), 408 (past ``--request-timeout``), or the prompt's 4xx.
    """
    try:
        job = server.engine.submit(lambda: server.job(req, encode(req), endpoint), endpoint,
                                   server.config.request_timeout)
    except QueueFullError as e:
        if server.engine.closing:  # arrived after the stop signal: 503, as for a job the shutdown ends
            raise shutting_down(counted=False) from None
        raise APIError(429, str(e), code="rate_limit_exceeded") from None
    watcher = asyncio.ensure_future(watch_disconnect(request.receive, job))
    streaming = False  # once the stream is handed over, it closes the job and the watcher
    try:
        try:
            spec = await job.start()
        except JobCancelled:
            return unfinished(server.engine)
        except QueueFullError:
            raise shutting_down() from None
        except RequestTimeout as e:
            raise timed_out(str(e), counted=True) from None
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        split = reply_splitter(server.tokenizer, req, spec.ids) if endpoint == "chat" else None
        if req.stream:  # the watcher stays: starlette may cancel the stream before it starts
            events = _events(server.engine, job, rid, req, watcher, split)
            streaming = True
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text, finish, usage = await _collect(job)
    finally:
        if not streaming:
            watcher.cancel()
            job.close()
    if finish is None:
        return unfinished(server.engine)
    if split is not None:
        message, finish = split.whole(text, finish)
        return JSONResponse(chat_completion(rid, req.model, message, finish, usage))
    return JSONResponse(text_completion(rid, req.model, text, finish, usage))


async def _collect(job: Job):
    """``(text, finish_reason, usage)`` of a whole job; finish_reason None if it did not finish."""
    text, finish, usage = [], None, None
    async for c in job:
        if c.error:
            if c.status == 408:
                raise timed_out(c.error, counted=True)
            raise APIError(500, c.error, type_="server_error", counted=True)
        text.append(c.text)
        finish, usage = c.finish_reason or finish, c.usage or usage
    return "".join(text), finish, usage


async def _events(engine: Any, job: Job, rid: str, req: Any, watcher: asyncio.Future,
                  split: Optional[ReplySplitter]) -> AsyncIterator[str]:
    """Deltas (a chat's split by ``split``), the finish chunk, the usage chunk if asked, then ``[DONE]``."""
    chat, finished, model = split is not None, False, req.model
    obj = "chat.completion.chunk" if chat else "text_completion"
    try:
        if chat:
            yield sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for c in job:
            finished = finished or bool(c.error or c.finish_reason)
            if c.error:
                yield sse(error_body(c.error, "server_error") if c.status != 408
                          else error_body(c.error, TIMEOUT_TYPE, code="request_timeout"))
                break
            delta = split.chunk(c.text, c.finish_reason) if chat else {}
            if delta or (c.text and not chat):
                yield sse(chat_chunk(rid, model, delta) if chat
                          else text_completion(rid, model, c.text, None, chunk=True))
            if c.finish_reason:
                yield sse(chat_chunk(rid, model, {}, split.finish_reason(c.finish_reason)) if chat
                          else text_completion(rid, model, "", c.finish_reason, chunk=True))
                if req.include_usage():
                    yield sse(usage_chunk(rid, model, obj, c.usage))
        if not finished and engine.closing:  # stopped by the shutdown, not by the client
            yield sse(error_body(shutting_down().message, "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        job.close()


def unfinished(engine: Any) -> Response:
    """A job that ended unfinished: 499 (its client went away), or APIError 503 while shutting down."""
    if engine.closing:
        raise shutting_down()
    return Response(status_code=499)


def shutting_down(counted: bool = True) -> APIError:
    """503; ``counted``: the engine counted the job already (else the refusal is counted as rejected)."""
    return APIError(503, "the server is shutting down", type_="server_error", counted=counted)


def sse(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
