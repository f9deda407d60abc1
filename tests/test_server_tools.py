"""Tool calls and reasoning in ``dflash serve``'s chat replies.

The splitting (``dflash_mlx.serve.tools``) is tested on text fed chunk by chunk with
a tokenizer that has mlx-lm's Qwen-style formats (``tool_fixtures``); the server on a
scripted target that "calls a tool" deterministically, served in-process, through
raw HTTP and through the official ``openai`` client (a whole round trip).
"""

from __future__ import annotations

import json
import logging

import pytest

from conftest import ByteTokenizer, app_client, live_app, openai_client, tiny_server_pair
from dflash_mlx.serve.api import ChatCompletionRequest
from dflash_mlx.serve.app import ServerConfig, chat_prompt_ids, create_app
from dflash_mlx.serve.tool_requests import MAX_SCHEMA_DEPTH, MAX_TOOL_CHARS, MAX_TOOLS
from dflash_mlx.serve.tools import ReplySplitter, parse_calls
from tool_fixtures import load_tool_tokenizer, scripted_pair, write_tool_tokenizer

openai = pytest.importorskip("openai")

MODEL = "tiny"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is 20C in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tool_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tool_tokenizer(tok_dir)


def replies(tok):
    """The scripted assistant: a thought and a call, or after a tool result, the answer."""
    response = tok.convert_tokens_to_ids("<tool_response>")
    return lambda prompt: ("<think>\nchecking\n</think>\n\n" + ANSWER if response in prompt
                           else "<think>\nI need the weather.\n</think>\n\n" + CALL)


@pytest.fixture(scope="module")
def pair(tok_dir, tok):
    return scripted_pair(tok_dir, replies(tok))


@pytest.fixture(scope="module")
def client(pair):
    with app_client(pair, MODEL, max_tokens=200) as c:
        yield c


def chat(content="What is the weather in Paris?", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def feed(split: ReplySplitter, text: str, step: int = 1):
    """Feed ``text`` ``step`` characters at a time; the joined fields and the deltas."""
    deltas = [split.feed(text[i:i + step]) for i in range(0, len(text), step)] + [split.finish()]
    whole = deltas[0]
    for d in deltas[1:]:
        whole.add(d)
    return whole, deltas


# -- splitting text ----------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_content_and_call_split_across_chunks(tok, step):
    split = ReplySplitter(tok, tok.encode("<|im_start|>assistant\n"), TOOLS)
    whole, deltas = feed(split, "<think>\nhmm\n</think>\n\nLet me check." + CALL, step)
    assert (whole.reasoning, whole.content) == ("\nhmm\n", "\n\nLet me check.")
    (call,) = whole.tool_calls
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert not any("<" in d.content + d.reasoning for d in deltas)  # no marker ever shown
    assert split.finish_reason("stop") == "tool_calls" and split.finish_reason("length") == "length"
    msg = whole.message()
    assert msg["content"] == "\n\nLet me check." and "index" not in msg["tool_calls"][0]


def test_reply_starts_in_reasoning_when_the_prompt_opens_thinking(tok):
    split = ReplySplitter(tok, tok.encode("<|im_start|>assistant\n<think>\n"), None)
    whole, _ = feed(split, "deep thought</think>Done.")
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("deep thought", "Done.", [])
    assert split.finish_reason("stop") == "stop"
    closed = ReplySplitter(tok, tok.encode("<think>\n\n</think>\n\n"), None)
    assert feed(closed, "Done.")[0].content == "Done."


def test_two_calls_are_indexed(tok):
    split = ReplySplitter(tok, [], TOOLS)
    whole, _ = feed(split, CALL + "\n" + CALL.replace("get_weather", "get_time"), 7)
    assert [(c["index"], c["function"]["name"]) for c in whole.tool_calls] == [(0, "get_weather"), (1, "get_time")]
    assert whole.message()["content"] == "\n"


def test_call_not_wanted_stays_content(tok):
    """Without tools (or with tool_choice "none") a call is text, markers and all,
    in the field it was written in."""
    whole, _ = feed(ReplySplitter(tok, [], None), "a" + CALL + "b", 5)
    assert whole.content == "a" + CALL + "b" and not whole.tool_calls
    whole, _ = feed(ReplySplitter(tok, [], None), "<think>a" + CALL + "b", 5)
    assert (whole.reasoning, whole.content) == ("a" + CALL, "b")  # mlx-lm's machine leaves thinking there


def test_unparseable_or_cut_call_is_content_and_logged(tok, caplog):
    bad = "<tool_call>{not json}</tool_call>"
    with caplog.at_level(logging.WARNING, "dflash.serve"):
        whole, _ = feed(ReplySplitter(tok, [], TOOLS), "x" + bad, 4)
        split = ReplySplitter(tok, [], TOOLS)
        cut, _ = feed(split, CALL[:30])  # max_tokens (or a stop string) ended it inside the call
    assert whole.content == "x" + bad and not whole.tool_calls
    assert cut.content == CALL[:30] and not cut.tool_calls and split.finish_reason("length") == "length"
    assert len([r for r in caplog.records if "could not be parsed" in r.getMessage()]) == 2
    whole, _ = feed(ReplySplitter(tok, [], TOOLS), "<think>" + bad)
    assert whole.reasoning == bad and not whole.content


def test_another_mlx_lm_format(tmp_path):
    """The format is whatever mlx-lm reads from the tokenizer: here Qwen3-Coder's,
    whose parser types the arguments by the tools' schema."""
    from tool_fixtures import CODER_TEMPLATE

    coder = load_tool_tokenizer(write_tool_tokenizer(tmp_path, CODER_TEMPLATE))
    assert coder.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"
    tools = [tool("get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}})]
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    whole, _ = feed(ReplySplitter(coder, [], tools), text, 4)
    (call,) = whole.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    # Sent back, the call's arguments reach the template decoded (it reads their items).
    req = ChatCompletionRequest.model_validate({"model": MODEL, "tools": tools, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "20C"}]})
    prompt = coder.decode(chat_prompt_ids(coder, req, {}))
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" in prompt


def test_plain_tokenizer_passes_text_through():
    split = ReplySplitter(ByteTokenizer(), [1, 2], TOOLS)
    whole, _ = feed(split, "<think>x</think>" + CALL, 5)
    assert whole.content == "<think>x</think>" + CALL and not whole.reasoning and not whole.tool_calls


@pytest.mark.parametrize("parsed", [[], "text", 3, {"arguments": {}}, [{"name": 1}], None,
                                    {"name": "f", "arguments": {"x": float("nan")}},
                                    {"name": "f", "arguments": {"x": {1, 2}}}])
def test_parser_output_that_is_not_a_call_fails(parsed):
    assert parse_calls(lambda text, tools: parsed, "", None) is None
    (call,) = parse_calls(lambda text, tools: {"name": "f", "id": "c1"}, "", None)
    assert call == {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


# -- the server --------------------------------------------------------------------


def test_tool_call_reply(client):
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "\nI need the weather.\n" and msg["content"] == "\n\n"
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def stream_events(client, body):
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_streamed_tool_call_reply(client):
    body = chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    events = stream_events(client, body)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == whole["tool_calls"][0]["function"]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"


def test_tool_choice_none_returns_the_exact_text(client):
    """The generated text is untouched: with tool_choice "none" the call is content."""
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none",
                                                      chat_template_kwargs={"enable_thinking": False}))
    msg, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    assert (msg["content"], finish) == ("\n\n" + CALL, "stop") and "tool_calls" not in msg
    assert msg["reasoning_content"] == "\nI need the weather.\n"


def test_max_tokens_and_stop_inside_the_reply(client):
    body = chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 40}).json()["choices"][0]
    assert r["finish_reason"] == "length" and "tool_calls" not in r["message"]
    assert r["message"]["content"].startswith("\n\n<tool_call>")  # the cut call, as written
    r = client.post("/v1/chat/completions", json={**body, "stop": ["weather"]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["message"]["reasoning_content"] == "\nI need the "
    assert r["message"]["content"] == "" and "tool_calls" not in r["message"]
    events = stream_events(client, {**body, "max_tokens": 40})
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events)


def test_named_tool_choice_shows_the_model_that_tool_only(client, pair, tok, caplog):
    """Decoding is not constrained: a named or required choice the model does not
    follow (cut by max_tokens here) gets its text, and the server logs it."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with caplog.at_level(logging.WARNING, "dflash.serve"):
        r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=choice, max_tokens=2))
        assert r.status_code == 200, r.text
        prompt = tok.decode(pair.target.seen)
        assert "get_weather" in prompt and "get_time" not in prompt
        r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required", max_tokens=2))
        assert r.status_code == 200 and "get_time" in tok.decode(pair.target.seen)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required"))
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert len([r for r in caplog.records if "answered without one" in r.getMessage()]) == 2


def deep(n: int):
    return {"type": "object", "properties": {"a": deep(n - 1)}} if n else {"type": "string"}


def tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools", "at most"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    ({"tools": [tool(), {"type": "custom", "custom": {"name": "f"}}]}, "tools.1.type", "only 'function' tools"),
    ({"tools": ["f"]}, "tools.0", ""),
    ({"tools": [tool("a b")]}, "tools.0.function.name", "pattern"),
    ({"tools": [tool("x" * 65)]}, "tools.0.function.name", "pattern"),
    ({"tools": [tool(), tool()]}, "tools.1.function.name", "twice"),
    ({"tools": [tool(parameters=[1])]}, "tools.0.function.parameters", "dictionary"),
    ({"tools": [tool(parameters=deep(MAX_SCHEMA_DEPTH))]}, "tools.0.function.parameters", "deeper"),
    ({"tools": [tool(description="d" * MAX_TOOL_CHARS)]}, "tools.0", f"at most {MAX_TOOL_CHARS}"),
    ({"tools": [tool(strict="yes")]}, "tools.0.function.strict", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"tools": [tool()], "tool_choice": "always"}, "tool_choice", ""),
    ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name", "not one of"),
    ({"tools": [tool()], "tool_choice": {"type": "function"}}, "tool_choice", ""),
])
def test_bad_tool_fields_are_400(client, fields, param, words):
    r = client.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "\n" not in err["message"], err


@pytest.mark.parametrize("calls,param", [
    ([{"type": "function", "function": {"name": "f", "arguments": "{not json"}}], "tool_calls.0.function.arguments"),
    ([{"type": "function", "function": {"name": "f", "arguments": "[1]"}}], "tool_calls.0.function.arguments"),
    ([{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}], "tool_calls.0.function.arguments"),
    ([{"type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}],
     "tool_calls.0.function.arguments"),
    ([{"type": "function"}], "tool_calls.0.function"),
    ([{"type": "function", "function": {"name": "f", "arguments": "{}"}}] * (MAX_TOOLS + 1), "tool_calls"),
])
def test_bad_tool_calls_in_messages_are_400(client, calls, param):
    body = {"model": MODEL, "tools": [tool()], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "1", "content": "r"}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"messages.1.{param}", r.json()


# -- a model without a tool-call format ----------------------------------------------


def test_no_tool_format_refuses_required_and_says_so_once(caplog):
    with app_client(tiny_server_pair()) as c, caplog.at_level(logging.WARNING, "dflash.serve"):
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            r = c.post("/v1/chat/completions", json=chat(tools=[tool()], tool_choice=choice))
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "no tool-call format" in r.json()["error"]["message"]
        logged = []
        for choice in ("none", "auto", "auto"):
            r = c.post("/v1/chat/completions", json=chat(tools=[tool()], tool_choice=choice, max_tokens=3))
            assert r.status_code == 200 and isinstance(r.json()["choices"][0]["message"]["content"], str)
            logged.append(len([r for r in caplog.records if "no tool-call format" in r.getMessage()]))
    assert logged == [0, 1, 1]  # "none" wants no call, so nothing is missing; then said once


# -- the round trip through the openai client ------------------------------------------


def test_openai_client_tool_round_trip(pair):
    """A tool defined, called, its result sent back, the final answer; then the same
    first turn streamed, its tool-call deltas put together as a client does."""
    app = create_app(pair, ServerConfig(model_id=MODEL, max_tokens=200))
    with live_app(app) as port:
        c = openai_client(f"http://127.0.0.1:{port}")
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto")
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        # Thinking is on by default (mlx-lm's template default): the prompt opened <think>.
        assert choice.message.model_extra["reasoning_content"] == "I need the weather.\n"
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 20})})
        final = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
        assert final.choices[0].message.content == "\n\n" + ANSWER
        assert final.choices[0].message.model_extra["reasoning_content"] == "checking\n"

        calls, finish = {}, None
        for chunk in c.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta
            for d in delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and list(calls) == [0]
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        assert calls[0]["id"].startswith("call_")


def test_parallel_tool_calls_false_returns_one_call_and_the_rest_as_text(tok, caplog):
    second = CALL.replace("get_weather", "get_time")
    with caplog.at_level(logging.WARNING, "dflash.serve"):
        whole, _ = feed(ReplySplitter(tok, [], TOOLS, single=True), CALL + "\n" + second, 7)
    assert [c["function"]["name"] for c in whole.tool_calls] == ["get_weather"]
    assert whole.content == "\n" + second  # as written, never dropped
    assert len([r for r in caplog.records if "parallel_tool_calls is false" in r.getMessage()]) == 1
    whole, _ = feed(ReplySplitter(tok, [], TOOLS, single=False), CALL + "\n" + second, 7)
    assert len(whole.tool_calls) == 2  # the default: every call


def test_parallel_tool_calls_is_read_and_checked(client):
    body = chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    for value in (False, True):
        r = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": value})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    r = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text
    assert ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False}).parallel_tool_calls is False
