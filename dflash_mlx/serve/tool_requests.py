"""The tool fields of a chat request (``tools``, ``tool_choice``, messages' ``tool_calls``) and their bounds; each
problem is ``(param, message)``, a 400 naming the field."""

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # tools per request, and tool calls per message
MAX_TOOL_CHARS = 32_768  # characters of one tool definition (its strings and keys)
MAX_SCHEMA_DEPTH = 32  # nesting of a tool's parameters (objects and lists)
NAME = r"^[A-Za-z0-9_-]{1,64}$"


class ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=NAME)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ToolFunction


class ChosenFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(pattern=NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


def depth(value: Any) -> int:
    """Nesting depth of lists and dicts in ``value`` (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 1 + max((depth(v) for v in value), default=0) if isinstance(value, list) else 0


def count_chars(value: Any) -> int:
    """Characters in every string (and dict key) inside ``value``."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + count_chars(v) for k, v in value.items())
    return sum(count_chars(v) for v in value) if isinstance(value, (list, tuple)) else 0


def other_tool_type(data: Any) -> Optional[tuple]:
    """The first raw tool whose ``type`` is not "function", or None."""
    tools = data.get("tools") if isinstance(data, dict) else None
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and "type" in tool and tool["type"] != "function":
            return f"tools.{i}.type", f"{tool['type']!r} is not served (only 'function' tools are)"
    return None


def tool_problem(tools: Optional[List[ToolDefinition]], choice: Optional[ToolChoice]) -> Optional[tuple]:
    """The first thing wrong with ``tools`` and ``tool_choice`` together, or None."""
    seen = set()
    for i, tool in enumerate(tools or []):
        where = f"tools.{i}.function"
        params = tool.function.parameters
        if params is not None and depth(params) > MAX_SCHEMA_DEPTH:
            return f"{where}.parameters", f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
        n = count_chars(tool.model_dump(exclude_none=True))
        if n > MAX_TOOL_CHARS:
            return f"tools.{i}", f"the tool definition is {n} characters; at most {MAX_TOOL_CHARS}"
        if tool.function.name in seen:
            return f"{where}.name", f"'{tool.function.name}' is defined twice"
        seen.add(tool.function.name)
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        what = repr(choice) if isinstance(choice, str) else "a named function"
        return "tool_choice", f"{what} needs tools (the request has none)"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        return "tool_choice.function.name", f"'{choice.function.name}' is not one of the request's tools"
    return None


def arguments_problem(calls: List[ToolCallIn]) -> Optional[tuple]:
    """The first call whose ``arguments`` is not a JSON object (param ``tool_calls.N.function.arguments``), or None."""
    for j, call in enumerate(calls):
        try:
            value = json.loads(call.function.arguments)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            return f"tool_calls.{j}.function.arguments", "must be a JSON object in a string"
    return None


def calls_for_template(calls: List[ToolCallIn]) -> List[Dict[str, Any]]:
    """Assistant tool calls as chat templates read them: arguments decoded to a dict."""
    out = []
    for call in calls:
        d = call.model_dump(exclude_none=True)
        d["function"]["arguments"] = json.loads(call.function.arguments)
        out.append(d)
    return out


def template_tools(tools: Optional[List[ToolDefinition]], choice: Optional[ToolChoice]) -> Optional[List[dict]]:
    """The tools the chat template renders: all, or the one a named ``tool_choice`` picks; None without tools."""
    if not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    return [t.model_dump(exclude_none=True) for t in tools]
