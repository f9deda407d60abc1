"""`dflash serve`'s bounds on a request's work and its answers to hostile input, on a
tiny random pair served in-process (no ../shared needed): templates from requests,
prompt length before tokenizing, tokenizing inside the engine's queue, timeouts, an
abandoned request stopping within one verify step, and 4xx (never 5xx) for bad bodies.

The HTTP calls go through the official `openai` client where it can send the request,
and through httpx (or a raw socket) for bodies it would refuse to build."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest

from conftest import SERVED, app_client, live_app, openai_client, parse_metrics, tiny_server_pair
from dflash_mlx.sampling import MIN_TEMP, Sampling
from dflash_mlx.serve.app import ServerConfig, create_app
from dflash_mlx.serve.guard import CHARS_PER_TOKEN
from dflash_mlx.serve.http_protocol import uvicorn_options

openai = pytest.importorskip("openai")

MODEL = SERVED
CONTEXT = 64  # tokens: keeps every request of the fuzz test short
PREFILL_FORWARDS = 1  # the target's forwards that prefill a short prompt ("Once upon")


@pytest.fixture(scope="module")
def pair():
    return tiny_server_pair(CONTEXT)


@pytest.fixture(scope="module", params=[1, 8], ids=["one-at-a-time", "batching"])
def client(pair, request):
    """The server one request at a time, and with continuous batching (--max-batch 8)."""
    with app_client(pair, max_batch=request.param) as c:
        yield c


def chat(content="Hi", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def check_error(r, status: int, param=None, words: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert "Traceback" not in r.text and words in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# -- templates from requests -------------------------------------------------------


def test_request_template_refused_by_default(client, pair):
    body = chat(chat_template_kwargs={"chat_template": "{% set x = 'a' * 500000000 %}{{ x }}"})
    check_error(client.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs.chat_template",
                "--allow-request-templates")
    for key in ("tokenize", "tools", "return_dict", "continue_final_message"):
        check_error(client.post("/v1/chat/completions", json=chat(chat_template_kwargs={key: True})), 400,
                    f"chat_template_kwargs.{key}", "set by the server")
    n = len(pair.tokenizer.template_kwargs)
    assert client.post("/v1/chat/completions", json=chat(chat_template_kwargs={"enable_thinking": True})
                       ).status_code == 200
    assert pair.tokenizer.template_kwargs[n:] == [{"enable_thinking": True}]


def test_request_template_allowed_with_the_flag():
    pair = tiny_server_pair()
    with app_client(pair, allow_request_templates=True) as c:
        r = c.post("/v1/chat/completions", json=chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}))
    assert r.status_code == 200, r.text
    assert pair.tokenizer.template_kwargs == [{"chat_template": "{{ 1 }}"}]


# -- prompt length before tokenizing, tokenizing in the queue -----------------------


def test_prompt_chars_checked_before_tokenizing(client, pair):
    cap = CHARS_PER_TOKEN * CONTEXT
    n = len(pair.tokenizer.threads)
    err = check_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (cap + 1)}), 400,
                      "prompt", f"at most {cap}")
    assert err["code"] == "context_length_exceeded"
    check_error(client.post("/v1/chat/completions", json=chat("a" * (cap + 1))), 400, "messages", "characters")
    two = {"model": MODEL, "messages": [{"role": "system", "content": "s" * cap}, {"role": "user", "content": "u"}]}
    check_error(client.post("/v1/chat/completions", json=two), 400, "messages")
    assert len(pair.tokenizer.threads) == n  # nothing was tokenized
    # Under the character cap but over the context in tokens: tokenized, then refused.
    check_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * CONTEXT}), 400, "prompt",
                f"context is {CONTEXT} tokens")


def test_max_prompt_chars_flag(pair):
    with app_client(pair, max_prompt_chars=10) as c:
        check_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 11}), 400, "prompt",
                    "at most 10")
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 10}).status_code == 200


def test_tokenizing_runs_on_the_engine_worker(client, pair):
    n = len(pair.tokenizer.threads)
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"}).status_code == 200
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    threads = pair.tokenizer.threads[n:]
    assert threads and all(t.startswith("dflash-engine") for t in threads), threads


# -- 4xx for bad values ------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny\\udfff", "prompt": "a"}', "model"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud800"}]}]}', "messages.0.content.0.text"),
    ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a"}], '
     '"tools": [{"type": "function", "x": "\\udc00"}]}', "tools.0.x"),
])
def test_lone_surrogates_are_400(client, path, body, param):
    check_error(client.post(path, content=body, headers={"Content-Type": "application/json"}), 400, param,
                "not valid Unicode")


# -- bodies as mlx_lm.server reads them -------------------------------------------------


FORM = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends


@pytest.mark.parametrize("headers", [FORM, {"Content-Type": "text/plain"}, {}], ids=["form", "text", "none"])
def test_json_body_read_whatever_its_content_type(client, headers):
    r = client.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Once"}), headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    r = client.post("/v1/chat/completions", content=json.dumps(chat()), headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


@pytest.mark.parametrize("body,words", [(b"model=tiny&prompt=Once", "not valid JSON"), (b"", "must be a JSON object"),
                                        (b"[1, 2]", "must be a JSON object"), (b"\xff\xfe{", "not valid JSON"),
                                        (b"[" * 100_000, "not valid JSON")],
                         ids=["form-fields", "empty", "array", "not-utf8", "deep"])
def test_a_body_that_is_not_a_json_object_is_400(client, body, words):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check_error(client.post(path, content=body, headers=FORM), 400, None, words)


def test_a_request_without_model_uses_the_served_model(client):
    out = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4}).json()
    named = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4}).json()
    assert out["model"] == MODEL and out["choices"][0]["text"] == named["choices"][0]["text"]
    body = chat()
    del body["model"]
    assert client.post("/v1/chat/completions", json=body).json()["model"] == MODEL
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and all(e["model"] == MODEL for e in events)
    check_error(client.post("/v1/completions", json={"model": "other", "prompt": "a"}), 404, "model", "not served")


@pytest.mark.parametrize("field,value", [("logprobs", True), ("top_logprobs", 2), ("n", 2), ("echo", True),
                                         ("best_of", 3), ("presence_penalty", 0.5), ("frequency_penalty", 1),
                                         ("logit_bias", {"1": 5}), ("response_format", {"type": "json_object"}),
                                         ("tool_choice", "required"), ("seed", -1), ("suffix", "x"),
                                         ("stop", "x" * 1001), ("stop", ["a", "x" * 1001])])
def test_unsupported_or_bad_fields_are_400(client, field, value):
    check_error(client.post("/v1/chat/completions", json=chat(**{field: value})), 400, field)


def test_unsupported_fields_at_their_defaults_are_accepted(client):
    body = chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0, n=1, logit_bias={},
                response_format={"type": "text"}, tool_choice="auto", user="someone")
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_empty_user_message_is_400(client):
    check_error(client.post("/v1/chat/completions", json=chat("")), 400, "messages.0.content", "needs text")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "assistant"},
                                         {"role": "user", "content": [{"type": "text", "text": ""}]}]}
    check_error(client.post("/v1/chat/completions", json=body), 400, "messages.2.content")
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a"}, {"role": "assistant"},
                                                         {"role": "user", "content": "b"}]}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200  # a content-less assistant turn is fine


def test_tiny_temperature_is_greedy(client):
    assert Sampling(5e-324).greedy and Sampling(MIN_TEMP / 2).greedy and not Sampling(MIN_TEMP).greedy
    greedy = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 8}).json()
    tiny = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 8,
                                                "temperature": 5e-324}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_request_timeout_is_408(pair):
    """A deadline of 0 s has passed before the worker takes the job: 408, not a generation."""
    with app_client(pair, request_timeout=0.0) as c:
        err = check_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a"}), 408, None,
                          "--request-timeout")
        assert err["code"] == "request_timeout" and err["type"] == "timeout"
        metrics = c.get("/metrics").text
    assert 'dflash_requests_total{endpoint="completions",outcome="timeout"} 1.0' in metrics
    assert 'outcome="invalid"' not in metrics  # counted once, as a timeout


# -- live server: disconnects and stalled bodies ----------------------------------------


def raw_request(port: int, body: bytes, path: str = "/v1/completions", length=None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def read_reply(sock: socket.socket) -> str:
    """One whole HTTP/1.1 response (its headers and Content-Length bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode()


@contextlib.contextmanager
def server_log_says(words: str):
    """An event set once the server's log (``dflash.serve``, INFO) holds a record with ``words``."""
    seen = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record):
            if words in record.getMessage():
                seen.set()

    logger, handler = logging.getLogger("dflash.serve"), Handler(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def wait_for(check, what: str, seconds: float = 60) -> None:
    """Poll ``check()`` until it is true; fail naming ``what`` after ``seconds`` (a bound, not a measure)."""
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, f"{what}: not after {seconds} s"
        time.sleep(0.02)


@pytest.mark.parametrize("streaming", [False, True])
def test_abandoned_request_stops_within_one_step(streaming):
    """A client that sends a request (streaming or not) and leaves once generation is
    under way: the target runs no forward after the step in progress when the server
    noticed, the request counts as cancelled, and the next request runs. The target holds
    its first decoding forward until the server logs the disconnect."""
    forwards, held, release = [], threading.Event(), threading.Event()

    def on_forward(inputs):
        forwards.append(inputs.shape[1])
        if len(forwards) == PREFILL_FORWARDS + 1:
            held.set()
            release.wait(60)

    pair = tiny_server_pair(context=4096, on_forward=on_forward)
    app = create_app(pair, ServerConfig(model_id=MODEL))
    with server_log_says("the client went away") as gone, live_app(app) as port:
        sock = raw_request(port, json.dumps({"model": MODEL, "prompt": "Once upon", "max_tokens": 400,
                                             "stream": streaming}).encode())
        assert held.wait(60)
        sock.close()
        assert gone.wait(60), "the server did not notice the disconnect"
        release.set()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: 'outcome="cancelled"} 1.0' in httpx.get(f"{url}/metrics").text, "counted cancelled")
        after = len(forwards) - (PREFILL_FORWARDS + 1)
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Next", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert after == 0, f"{after} forwards for the abandoned request after the step under way at the close"
    assert app.state.server.engine.pair_cache.is_consistent()


def test_stalled_body_is_408():
    pair = tiny_server_pair()
    app = create_app(pair, ServerConfig(model_id=MODEL, idle_timeout=0.2))
    with live_app(app) as port:
        sock = raw_request(port, b'{"model": "tiny", ', length=100)  # promises 100 bytes, sends 18
        reply = read_reply(sock)
        sock.close()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "--idle-timeout" in reply and '"type": "timeout"' in reply.replace('":"', '": "')


def test_openai_client_gets_400_for_a_request_template(pair):
    app = create_app(pair, ServerConfig(model_id=MODEL))
    with live_app(app) as port:
        c = openai_client(f"http://127.0.0.1:{port}", timeout=60)
        with pytest.raises(openai.BadRequestError, match="allow-request-templates"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3


def test_abandoned_during_prefill_stops_between_chunks():
    """A job closed while its prompt is prefilled stops before the next chunk (16
    tokens here): 3 chunks of a 300-token prompt run, none is generated, and the
    caches hold what the next request can trust (its output equals a fresh run's)."""
    import asyncio

    import mlx.core as mx

    from dflash_mlx import generate_step
    from dflash_mlx.serve.engine import Engine, GenerationJob
    from dflash_mlx.serve.metrics import ServerMetrics

    forwards, jobs, submitted = [], [], threading.Event()

    def on_forward(inputs):  # the first job is closed during its third chunk
        submitted.wait(60)
        forwards.append(inputs.shape[1])
        if len(forwards) == 3:
            jobs[0].close()

    pair = tiny_server_pair(context=4096, on_forward=on_forward)
    ids = [3 + i % 200 for i in range(300)]

    async def main():
        engine = Engine(pair, metrics=ServerMetrics(16), prefill_step_size=16)
        jobs.append(engine.submit(GenerationJob(ids, 50)))
        submitted.set()
        async for _ in jobs[0]:
            pass
        first = len(forwards)
        out = []
        async for c in engine.submit(GenerationJob(ids[:40], 12)):
            out.append(c)
        engine.shutdown()
        return engine, first, out

    engine, first, out = asyncio.run(main())
    assert first == 3 and forwards[:3] == [16] * 3  # stopped after the third chunk, out of 19
    counts = parse_metrics(engine.metrics.render().decode())
    assert counts['dflash_requests_total{endpoint="chat",outcome="cancelled"}'] == 1
    assert counts["dflash_generation_tokens_total"] == 12  # the second job's only
    assert engine.pair_cache.is_consistent()
    steps = generate_step(mx.array(ids[:40], dtype=mx.int32), pair.target, pair.drafter, max_tokens=12)
    fresh = [t for s in steps for t in s.tokens]
    assert "".join(c.text for c in out) == pair.tokenizer.decode(fresh)


@pytest.mark.parametrize("streaming", [False, True])
def test_request_timeout_mid_generation(streaming):
    """The deadline passing while a reply is generated stops it after that step: a 408,
    or for a stream an error event with code request_timeout and no finish_reason;
    counted as a timeout. The target holds its fifth forward until the deadline
    (--request-timeout 1.5 s, set before the first forward) has passed."""
    timeout, starts = 1.5, []

    def on_forward(inputs):
        starts.append(time.monotonic())
        if len(starts) == 5:
            time.sleep(max(0.0, starts[0] + timeout + 0.05 - time.monotonic()))

    pair = tiny_server_pair(context=4096, on_forward=on_forward)
    with app_client(pair, request_timeout=timeout) as c:
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 300, "stream": streaming}
        r = c.post("/v1/completions", json=body)
        metrics = c.get("/metrics").text
    if streaming:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "request_timeout"  # then [DONE], as after any error event
        assert events[-1]["error"]["type"] == "timeout"
        assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
    else:
        err = check_error(r, 408, None, "--request-timeout")
        assert err["code"] == "request_timeout" and err["type"] == "timeout"
    assert 'dflash_requests_total{endpoint="completions",outcome="timeout"} 1.0' in metrics
    generated = float(next(l.split()[-1] for l in metrics.splitlines()
                           if l.startswith("dflash_generation_tokens_total")))
    assert 0 < generated < 300 and len(starts) == 5  # no forward after the one the deadline passed in


# -- HTTP limits of a server facing the network (a live server, real sockets) -------------


def closed_or_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_headers_that_never_come_are_timed_out(pair):
    """A connection that sends nothing, and one that trickles its headers a byte at a time
    (each byte well within the timeout, so uvicorn's keep-alive would never fire), are
    closed after --idle-timeout; the trickling one gets a 408 typed timeout. The header
    is long enough that sending it all would take minutes."""
    app = create_app(pair, ServerConfig(model_id=MODEL, idle_timeout=0.5))
    with live_app(app, **uvicorn_options(0.5, 64)) as port:
        silent = socket.create_connection(("127.0.0.1", port), timeout=60)
        assert closed_or_reply(silent) == b""
        silent.close()
        slow = socket.create_connection(("127.0.0.1", port), timeout=60)
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 2000 + b"\r\n\r\n"
        sent = 0
        for byte in head:
            try:
                slow.sendall(bytes([byte]))
            except OSError:  # closed by the server
                break
            sent += 1
            if select.select([slow], [], [], 0.1)[0]:
                break
        reply = closed_or_reply(slow).decode()
        slow.close()
        assert sent < len(head), "the server waited for the whole trickled header"
        assert reply.startswith("HTTP/1.1 408"), reply
        body = json.loads(reply.partition("\r\n\r\n")[2])
        assert body["error"]["type"] == "timeout" and "--idle-timeout" in body["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


def test_oversized_headers_are_431(pair):
    """200 KB of headers: a 431 as OpenAI's JSON error, read by the client (no reset)."""
    app = create_app(pair, ServerConfig(model_id=MODEL))
    with live_app(app, **uvicorn_options(5.0, 64)) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        reply = closed_or_reply(sock).decode()
        sock.close()
        assert reply.startswith("HTTP/1.1 431"), reply
        err = json.loads(reply.partition("\r\n\r\n")[2])["error"]
        assert err["code"] == "request_header_fields_too_large" and "headers are larger" in err["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


def test_connections_past_the_limit_get_503(pair):
    app = create_app(pair, ServerConfig(model_id=MODEL))
    with live_app(app, **uvicorn_options(60.0, 3)) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(3)]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        for s in idle:
            s.close()
        for _ in range(600):  # until the server has seen them close (not deciding anything)
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


@pytest.fixture(scope="module")
def keyed(pair):
    """A live server with an API key; yields its URL."""
    app = create_app(pair, ServerConfig(model_id=MODEL, max_tokens=4, api_key="sekrit"))
    with live_app(app, **uvicorn_options(5.0, 64)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("header,status", [("Bearer sekrit", 200), ("bearer sekrit", 200), ("BEARER  sekrit", 200),
                                           ("Basic sekrit", 401), ("Bearer wrong", 401), ("sekrit", 401)])
def test_auth_scheme_is_case_insensitive(keyed, header, status):
    r = httpx.get(f"{keyed}/v1/models", headers={"Authorization": header})
    assert r.status_code == status, r.text


def test_tool_message_needs_tool_call_id(keyed):
    c = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sekrit", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "20C"}]
    with pytest.raises(openai.BadRequestError, match="tool_call_id") as e:
        c.chat.completions.create(model=MODEL, messages=messages)
    assert e.value.body["param"] == "messages.2.tool_call_id"
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        c.chat.completions.create(model=MODEL, messages=messages[:2] + [{**messages[2], "tool_call_id": ""}])
    r = c.chat.completions.create(model=MODEL, messages=messages[:2] + [{**messages[2], "tool_call_id": "c1"}])
    assert r.choices[0].finish_reason == "length"


def test_prompt_plus_max_tokens_past_the_context_is_400(keyed):
    c = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sekrit", max_retries=0, timeout=60)
    prompt = list(range(3, 3 + 50))
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    assert "the prompt is 50 tokens and max_tokens is 20, past the model's context of 64" in e.value.message
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens is 20, past"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * 30}],
                                  max_completion_tokens=20)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=14)  # exactly the context
    assert r.usage.completion_tokens == 14 and r.choices[0].finish_reason == "length"
    r = c.completions.create(model=MODEL, prompt=list(range(3, 3 + 62)))  # the default is capped: 2 left
    assert r.usage.completion_tokens == 2
