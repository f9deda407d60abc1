"""A chat reply's text split into ``content``, ``reasoning_content`` and ``tool_calls`` by the tokenizer's mlx-lm
formats; a call not wanted or not parsed stays text where it was written."""

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from .http_errors import APIError

log = logging.getLogger("dflash.serve")

REASONING, TOOL = "reasoning", "tool"  # mlx-lm's state names


@dataclass
class Delta:
    """What a piece of reply adds to ``content``, ``reasoning_content`` and ``tool_calls`` (OpenAI's, with index)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)

    def add(self, other: "Delta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)

    def stream_delta(self) -> Dict[str, Any]:
        fields = {"reasoning_content": self.reasoning, "content": self.content, "tool_calls": self.tool_calls}
        return {k: v for k, v in fields.items() if v}

    def message(self) -> Dict[str, Any]:
        """A ``chat.completion``'s ``message`` fields but its role."""
        out: Dict[str, Any] = {"content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
        return out


def initial_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """"reasoning" when ``prompt`` ends inside an open thinking tag, else "normal" (as mlx-lm's server)."""
    inside = getattr(tokenizer, "has_thinking", False) and (
        tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt))
    return getattr(tokenizer, "response_initial_state", None) or (REASONING if inside else "normal")


class ReplySplitter:
    """Splits one reply's text, fed chunk by chunk, into :class:`Delta` pieces. ``tools``: None when calls are not
    wanted; ``required``: a reply without a call is logged; ``single``: calls after the first stay text."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int], tools: Optional[List[Dict[str, Any]]],
                 required: bool = False, single: bool = False):
        thinking = getattr(tokenizer, "has_thinking", False)
        calling = getattr(tokenizer, "has_tool_calling", False)
        self.machine = make_text_state_machine(tokenizer) if thinking or calling else None
        self.state = self.machine.make_state(initial_state(tokenizer, prompt)) if self.machine else None
        self.parser: Optional[Callable] = tokenizer.tool_parser if calling and tools is not None else None
        self.markers = (tokenizer.tool_call_start, tokenizer.tool_call_end or "") if calling else ("", "")
        self.tools, self.calls, self.required, self.single = tools, 0, required, single
        self._where, self._tool_text, self._origin = "normal", "", "normal"  # _origin: where the call began

    def feed(self, text: str) -> Delta:
        """What ``text`` adds (text that may begin a marker is held back)."""
        if self.machine is None:
            return Delta(content=text)
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._take(segments)

    def finish(self) -> Delta:
        """The rest: held-back text, and a tool call left open."""
        out = Delta()
        if self.machine is not None:
            self.state, rest, where = TextStateMachine.flush(self.state)
            out = self._take([(where, rest)])
            if self._where == TOOL:
                out.add(self._close_call(ended=False))
                self._where = "normal"
        if self.required and not self.calls:
            log.warning("tool_choice asked for a tool call and the model answered without one; the reply is "
                        "returned as it is (decoding is not constrained, the output is the target's own)")
        return out

    def whole(self, text: str, reason: Optional[str]) -> Tuple[Dict[str, Any], Optional[str]]:
        out = self.feed(text)
        out.add(self.finish())
        return out.message(), self.finish_reason(reason)

    def chunk(self, text: str, reason: Optional[str]) -> Dict[str, Any]:
        """The ``delta`` of one streamed step's ``text`` (with ``reason``: and the rest)."""
        out = self.feed(text)
        if reason is not None:
            out.add(self.finish())
        return out.stream_delta()

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """``reason``, or "tool_calls" for a reply that called a tool and stopped."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _take(self, segments) -> Delta:
        out = Delta()
        for where, text in segments:
            if self._where == TOOL and where != TOOL:
                out.add(self._close_call(ended=True))
            if where == REASONING:
                out.reasoning += text
            elif where == TOOL:
                if self._where != TOOL:
                    self._origin = self._where
                self._tool_text += text
            else:
                out.content += text
            self._where = where
        return out

    def _close_call(self, ended: bool) -> Delta:
        text, self._tool_text = self._tool_text, ""
        start, end = self.markers
        raw = start + text + (end if ended else "")
        as_text = Delta(reasoning=raw) if self._origin == REASONING else Delta(content=raw)
        if self.parser is None:  # tool calls not wanted: the call stays text, where it was written
            return as_text
        calls = parse_calls(self.parser, text, self.tools)
        if calls is None:
            log.warning("a tool call of %d characters could not be parsed by %s%s; returned as text",
                        len(raw), getattr(self.parser, "__module__", "the tool parser"),
                        "" if ended else " (the reply ended inside it)")
            return as_text
        if self.single and self.calls + len(calls) > 1:
            log.warning("parallel_tool_calls is false and the reply holds %s tool call; returned as text",
                        "another" if self.calls else "more than one")
            return as_text
        out = Delta(tool_calls=[{"index": self.calls + i, **c} for i, c in enumerate(calls)])
        self.calls += len(calls)
        return out


def reply_splitter(tokenizer: Any, req: Any, prompt: Sequence[int]) -> ReplySplitter:
    tools = req.template_tools() if req.tools and req.tool_choice != "none" else None  # calls returned as tool_calls
    return ReplySplitter(tokenizer, prompt, tools, required=req.tool_choice not in (None, "none", "auto"),
                         single=req.parallel_tool_calls is False)


def parse_calls(parser: Callable, text: str, tools: Optional[List[dict]]) -> Optional[List[Dict[str, Any]]]:
    """The calls ``parser`` reads in ``text`` as OpenAI ``tool_calls`` entries; None when it fails."""
    try:
        parsed = parser(text, tools)
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return [openai_call(c) for c in calls]
    except Exception:  # noqa: BLE001 - model output is untrusted; the caller logs it
        return None


def openai_call(call: Dict[str, Any]) -> Dict[str, Any]:
    """A parsed call as OpenAI's ``tool_calls`` entry; TypeError, ValueError: arguments JSON cannot encode."""
    args = call.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False, allow_nan=False)
    cid = call.get("id") if isinstance(call.get("id"), str) else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": cid, "type": "function", "function": {"name": call["name"], "arguments": args}}


def check_tool_support(tokenizer: Any, tools: bool, choice: Any, warned: set) -> None:
    """Log once (``warned``) what this model does instead of tool calls.

    Raises:
        APIError: 400 ``tools`` without a chat template; 400 ``tool_choice`` asking for a call it cannot parse.
    """
    if tools and not getattr(tokenizer, "has_chat_template", False):
        raise APIError(400, "tools: this model has no chat template, so nothing can show it the tools; send the "
                            "request without tools", "tools")
    if not tools or choice == "none" or getattr(tokenizer, "has_tool_calling", False):
        return  # "none": no call is wanted, so nothing is missing
    if choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice: this model has no tool-call format that mlx-lm can parse, so no "
                            "tool call can be returned; send 'auto' or 'none' (the reply is then text)",
                       "tool_choice")
    if "no-tool-format" not in warned:
        warned.add("no-tool-format")
        log.warning("a request sent tools, but this model's tokenizer has no tool-call format that mlx-lm "
                    "can parse: the tools go to the chat template and the reply is returned as text")
