"""Hostile tool fields and hostile model output for ``dflash serve``'s tool calls:
hostile ``tools``, ``tool_choice`` and sent-back ``tool_calls`` get a 2xx or a one-line
4xx, never a 5xx; and however a reply mixing markers and text is chunked, streaming
gives the fields a whole reply gets (hypothesis, derandomized, so a failure
reproduces). The pair and helpers are ``test_server_tools``'s."""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from dflash_mlx.serve.tools import ReplySplitter  # noqa: E402
from request_fuzz import ANY_TEXT, JSON_VALUES  # noqa: E402
from test_server_tools import MODEL, TOOLS, client, pair, tok, tok_dir  # noqa: E402,F401 - fixtures

PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": [1]}}',
          '{"name": 1}', "x", "{", "<", "<tool", "call>", "\n", "é"]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(1, 9), max_size=30),
       opened=st.booleans())
def test_split_does_not_depend_on_chunking(tok, pieces, cuts, opened):
    """Whatever the model writes and however the engine chunks it, streaming gives the
    fields a whole reply gets; text without markers is content, unchanged."""
    text, prompt = "".join(pieces), tok.encode("<think>" if opened else "x")
    whole, reason = ReplySplitter(tok, prompt, TOOLS).whole(text, "stop")
    split, at, deltas = ReplySplitter(tok, prompt, TOOLS), 0, []
    for n in cuts + [len(text)]:
        deltas.append(split.chunk(text[at:at + n], "stop" if at + n >= len(text) else None))
        at += n
        if at >= len(text):
            break
    assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.get("reasoning_content", "")
    streamed = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    assert streamed == [c["function"] for c in whole.get("tool_calls", [])]
    assert split.finish_reason("stop") == reason
    if not opened and not any(m in text for m in ("<think>", "<tool_call>")):
        assert whole["content"] == text  # nothing to split: the text as generated


def _tool():
    name = st.sampled_from(["get_weather", "f", "a b", "", "x" * 65]) | ANY_TEXT
    function = st.fixed_dictionaries({"name": name}, optional={
        "description": ANY_TEXT | JSON_VALUES, "parameters": JSON_VALUES | st.just({"type": "object"}),
        "strict": JSON_VALUES})
    return (st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]) | JSON_VALUES,
                                   "function": function | JSON_VALUES}) | JSON_VALUES)


def _call():
    function = st.fixed_dictionaries({"name": ANY_TEXT, "arguments": st.sampled_from(['{"a": 1}', "{}", "[", ""])
                                      | ANY_TEXT | JSON_VALUES})
    return st.fixed_dictionaries({"type": st.just("function") | JSON_VALUES, "function": function | JSON_VALUES},
                                 optional={"id": ANY_TEXT | JSON_VALUES})


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(tools=st.just(TOOLS) | st.just(TOOLS) | st.lists(_tool(), max_size=3) | JSON_VALUES,
       choice=st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}},
                               {"type": "function", "function": {"name": "f"}}]) | JSON_VALUES,
       calls=st.just([]) | st.just([{"type": "function", "id": "1", "function": {"name": "f", "arguments": "{}"}}])
       | st.lists(_call(), max_size=2) | JSON_VALUES, stream=st.booleans())
def test_hostile_tool_fields_get_2xx_or_one_line_4xx(client, tools, choice, calls, stream):
    body = {"model": MODEL, "max_tokens": 3, "stream": stream, "tools": tools, "tool_choice": choice,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "1", "content": "r"}]}
    r = client.post("/v1/chat/completions", content=json.dumps(body, allow_nan=True),
                    headers={"Content-Type": "application/json"})
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and "\n" not in err["message"] and "Traceback" not in r.text
