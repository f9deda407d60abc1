"""The OpenAI API as ``dflash serve`` speaks it: strict request models (unimplemented fields refused unless at
their default, lone surrogates refused; errors of type :data:`REQUEST_ERROR`) and the response bodies."""

import time
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ..stats import GenerationStats
from .tool_requests import (
    MAX_TOOLS, ToolCallIn, ToolChoice, ToolDefinition, arguments_problem, calls_for_template, other_tool_type,
    template_tools, tool_problem)


MAX_STOP = 16  # stop strings per request (OpenAI takes 4)
MAX_STOP_CHARS = 1000  # characters per stop string (each is matched at every step)
REQUEST_ERROR = "dflash_request"  # pydantic error type of the checks below; ctx["param"] names the field
TIMEOUT_TYPE = "timeout"  # the error type of a 408: the request was well formed, time ran out

# OpenAI fields not implemented here, each with the values that mean "not used".
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none"),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"])}


def request_error(param: str, message: str) -> PydanticCustomError:
    """A validation error naming ``param`` (a dotted path)."""
    return PydanticCustomError(REQUEST_ERROR, "{param}: {message}", {"param": param, "message": message})


def first_bad_string(value: Any, path: str = "") -> Optional[str]:
    """The dotted path of the first string (or dict key) UTF-8 cannot encode (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and first_bad_string(k) is not None:
            return path or "body"
        if (bad := first_bad_string(v, f"{path}.{k}" if path else str(k))) is not None:
            return bad
    return None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str

class ChatMessage(BaseModel):
    """One message; ``tool_calls`` and extra keys (``tool_call_id``, ``name``) go to the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None
    tool_calls: Optional[List[ToolCallIn]] = Field(None, max_length=MAX_TOOLS)

    def text(self) -> str:
        return "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""

    def for_template(self) -> Dict[str, Any]:
        out = {**self.model_dump(exclude_none=True), "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = calls_for_template(self.tool_calls)
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields both endpoints share (greedy by default)."""

    model_config = ConfigDict(strict=True)
    model: Optional[str] = None  # None: the served model
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                Annotated[List[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)],
                None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_cannot_be_served(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic says "must be an object"
        if (bad := first_bad_string(data)) is not None:
            raise request_error(bad, "not valid Unicode (a lone surrogate such as \\ud800)")
        for name, defaults in UNSUPPORTED.items():
            value = data.get(name)  # compared with its type: True is not taken for 1 nor 0 for False
            if name in data and not any(type(value) is type(d) and value == d for d in defaults):
                raise request_error(name, f"not supported by this server (send {defaults[-1]!r} or leave it out)")
        return data

    def stop_strings(self) -> List[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``; ``tools`` and ``chat_template_kwargs`` go to the chat template."""

    messages: List[ChatMessage] = Field(min_length=1)
    tools: Optional[List[ToolDefinition]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        if (bad := other_tool_type(data)) is not None:
            raise request_error(*bad)
        return data

    @model_validator(mode="after")
    def _messages_and_tools(self) -> "ChatCompletionRequest":
        for i, m in enumerate(self.messages):
            if m.role == "user" and not m.text():
                raise request_error(f"messages.{i}.content", "a user message needs text (it is empty)")
            call_id = (m.model_extra or {}).get("tool_call_id")
            if m.role == "tool" and not (isinstance(call_id, str) and call_id):
                raise request_error(f"messages.{i}.tool_call_id", "a tool message needs tool_call_id, a "
                                    "non-empty string: the id of the assistant's tool call it answers")
            if (bad := arguments_problem(m.tool_calls or [])) is not None:
                raise request_error(f"messages.{i}.{bad[0]}", bad[1])
        if (bad := tool_problem(self.tools, self.tool_choice)) is not None:
            raise request_error(*bad)
        return self

    def template_tools(self) -> Optional[List[Dict[str, Any]]]:
        return template_tools(self.tools, self.tool_choice)


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: a text prompt (one string), or its token ids."""

    prompt: Union[str, List[str], List[int]]

    def prompt_value(self) -> Union[str, List[int]]:
        """The one prompt: a string, or token ids; ValueError for a list of several strings."""
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request (got a list of several)")
            return p[0]
        return p


def usage(stats: GenerationStats) -> Dict[str, Any]:
    """The ``usage`` object: OpenAI's counts (``cached_tokens``: found in the caches), ``dflash``: the stats."""
    d = stats.to_dict(trace=False)
    d.pop("prompt_tokens")
    d.pop("tokens")
    return {
        "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_reused}, "dflash": d}


def _envelope(rid: str, object_: str, model: str, **fields: Any) -> Dict[str, Any]:
    return {"id": rid, "object": object_, "created": int(time.time()), "model": model, **fields}


def chat_completion(rid: str, model: str, message: Dict[str, Any], finish_reason: Optional[str],
                    usage_: Optional[dict]) -> Dict[str, Any]:
    """A whole ``chat.completion``; ``message``: its fields but the role."""
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(rid, "chat.completion", model, choices=[choice], usage=usage_)


def chat_chunk(rid: str, model: str, delta: Dict[str, Any], finish_reason: Optional[str] = None) -> Dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(rid, "chat.completion.chunk", model, choices=[choice])


def text_completion(rid: str, model: str, text: str, finish_reason: Optional[str],
                    usage_: Optional[dict] = None, chunk: bool = False) -> Dict[str, Any]:
    out = _envelope(rid, "text_completion", model,
                    choices=[{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}])
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def usage_chunk(rid: str, model: str, object_: str, usage_: dict) -> Dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return _envelope(rid, object_, model, choices=[], usage=usage_)


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
