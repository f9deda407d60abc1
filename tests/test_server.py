"""`dflash serve` end to end: a live server on 127.0.0.1 (a free port) serving the real
stories260K with a drafter, driven by the official `openai` client and by raw HTTP.

Greedy output equals `dflash generate` on the same prompt (run in-process through the
CLI app), under load too; every bad request gets OpenAI's JSON error with a 4xx code.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conftest import ROOT, dflash, live_server, needs_shared, openai_client, parse_metrics

openai = pytest.importorskip("openai")

pytestmark = needs_shared

KEY = "test-key"
PROMPTS = ["Once upon a time", "One day, a little boy", "The cat sat on", "Lily and Ben went to",
           "Tom had a big red"]
N = 16  # tokens per request: small, so the file runs in well under a minute


@pytest.fixture(scope="module")
def server(stories, random_drafter, tmp_path_factory):
    """(base URL, log file) of a server with a drafter, an API key and a 10 KB body cap,
    running requests one at a time (--max-batch 1: the prompt cache, the queue's waits;
    tests/test_server_batch_live.py runs the batching server)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with live_server(log, "--model", str(stories), "--draft-model", str(random_drafter), "--api-key", KEY,
                     "--max-body-mb", str(10_000 / 2**20), "--log-level", "info", "--max-batch", "1") as url:
        yield url, log


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0], KEY, timeout=60)


@pytest.fixture(scope="module")
def model(stories):
    return str(stories)


@pytest.fixture(scope="module")
def reference(stories, random_drafter):
    """`dflash generate --json` on a prompt (greedy, the CLI's own code path); memoized."""
    from dflash_mlx.cli.app import app

    memo = {}

    def run(prompt: str, n: int = N) -> str:
        if (prompt, n) not in memo:
            r = CliRunner().invoke(app, ["generate", "--model", str(stories), "--draft-model",
                                         str(random_drafter), "-p", prompt, "-m", str(n), "--json", "--quiet"])
            assert r.exit_code == 0, r.output
            memo[prompt, n] = json.loads(r.stdout)["text"]
        return memo[prompt, n]

    return run


def metrics(url: str) -> dict:
    """``{"name{labels}": value}`` of /metrics."""
    return parse_metrics(httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)


def post(url: str, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{url}{path}", content=body, headers={**headers, "Content-Type": "application/json"},
                      timeout=60, **kw)


def check_dflash_usage(usage, prompt_tokens=None):
    d = usage.model_extra["dflash"] if hasattr(usage, "model_extra") else usage["dflash"]
    completion = usage.completion_tokens if hasattr(usage, "completion_tokens") else usage["completion_tokens"]
    assert d["speculative"] is True and d["reason"] is None and d["block_size"] == 8
    assert d["steps"] + d["plain_steps"] >= 1  # auto may decode plainly: then no tau
    assert d["tau"] >= 1.0 if d["steps"] else d["tau"] is None
    assert d["verify"]["block_size"] == "auto" and sum(d["widths"].values()) == d["steps"] + d["plain_steps"]
    assert sum(d["acceptance_histogram"].values()) == d["steps"]
    assert d["generation_tokens"] == completion
    # measured as generate measures them, never left at zero or null
    assert d["peak_memory"] > 0 and d["bandwidth_gbps"] > 0 and min(d["timings_ms"].values()) > 0
    assert d["prompt_tps"] > 0 and d["generation_tps"] > 0 and d["block_attention"]["block_attention"]
    assert d["prompt_tokens_reused"] + d["prompt_tokens_prefilled"] == (
        prompt_tokens if prompt_tokens is not None else d["prompt_tokens_reused"] + d["prompt_tokens_prefilled"])
    return d


# -- the openai client ------------------------------------------------------------


def test_reference_outputs_are_varied(reference):
    outs = [reference(p) for p in PROMPTS]
    assert len(set(outs)) == len(PROMPTS) and all(len(o) > 20 for o in outs)


def test_chat_equals_dflash_generate(client, model, reference):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference(PROMPTS[0])
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.completion_tokens == N and r.usage.total_tokens == r.usage.prompt_tokens + N
    check_dflash_usage(r.usage, r.usage.prompt_tokens)


def test_chat_stream_equals_dflash_generate(client, model, reference):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_completion_tokens=N,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(PROMPTS[1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    check_dflash_usage(chunks[-1].usage, chunks[-1].usage.prompt_tokens)


def test_completions_equal_dflash_generate(client, model, reference):
    r = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=N)
    assert r.choices[0].text == reference(PROMPTS[2]) and r.choices[0].finish_reason == "length"
    check_dflash_usage(r.usage, r.usage.prompt_tokens)
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=N, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference(PROMPTS[3])
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


def test_stop_sequences(client, model, reference):
    ref = reference(PROMPTS[0], 40)
    stop = ref.split()[5]  # a word some way into the reply
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=40, stop=["#never#", stop])
    assert r.choices[0].message.content == ref[: ref.index(stop)]
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    chunks = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == ref[: ref.index(stop)]


def test_prefix_is_reused_from_the_cache(client, model, reference):
    first = client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=N)
    longer = PROMPTS[4] + first.choices[0].text
    r = client.completions.create(model=model, prompt=longer, max_tokens=N)
    d = check_dflash_usage(r.usage, r.usage.prompt_tokens)
    assert r.usage.prompt_tokens_details.cached_tokens == d["prompt_tokens_reused"] >= first.usage.prompt_tokens
    assert r.choices[0].text == reference(longer)


def test_seeded_sampling_is_reproducible(client, model):
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a


def test_models_health_metrics(client, server, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert httpx.get(f"{server[0]}/health").json()["status"] == "ok"  # open without the key
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N)
    m = metrics(server[0])
    for name in ("dflash_tau", "dflash_acceptance_rate", "dflash_generation_tokens_per_second",
                 "dflash_generation_tokens_total", "dflash_verify_steps_total"):
        assert name in m
    assert m['dflash_requests_total{endpoint="chat",outcome="completed"}'] >= 1


# -- load ----------------------------------------------------------------------


def test_load_8_clients_and_a_disconnect(server, model, reference):
    """8 concurrent clients x 5 requests, mixed chat/completions, streaming or not, plus
    one client that leaves mid-stream: all complete, all equal the sequential result,
    the server stays up and /metrics adds up."""
    url, log = server
    refs = {p: reference(p) for p in PROMPTS}
    before = metrics(url)
    results, errors = [], []

    def one(c: openai.OpenAI, i: int, k: int):
        prompt, stream, chat = PROMPTS[(i + k) % len(PROMPTS)], (i + k) % 2 == 0, (i * 5 + k) % 3 != 0
        if chat:
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=N, stream=stream, stream_options={"include_usage": True}
                                          if stream else None)
            if stream:
                chunks = list(r)
                text = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
                usage = chunks[-1].usage
            else:
                text, usage = r.choices[0].message.content, r.usage
        else:
            r = c.completions.create(model=model, prompt=prompt, max_tokens=N, stream=stream,
                                     stream_options={"include_usage": True} if stream else None)
            if stream:
                chunks = list(r)
                text = "".join(x.choices[0].text for x in chunks if x.choices)
                usage = chunks[-1].usage
            else:
                text, usage = r.choices[0].text, r.usage
        results.append((prompt, text, usage.prompt_tokens, usage.completion_tokens))

    def client_loop(i: int):
        c = openai_client(url, KEY)
        try:
            for k in range(5):
                one(c, i, k)
                if i == 0 and k == 1:
                    leave_mid_stream()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    left = []

    def leave_mid_stream():
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    left.append(line)
                if len(left) >= 3:
                    break  # close the connection with the generation under way

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(8)]
    tic = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "clients still running after 180 s"
    assert not errors, errors
    assert len(results) == 40 and len(left) == 3
    for prompt, text, _, _ in results:
        assert text == refs[prompt], prompt
    assert time.monotonic() - tic < 180

    # The server is up, and the caches are consistent: the next request is still exact.
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    r = post(url, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": N}).json()
    assert r["choices"][0]["text"] == refs[PROMPTS[0]]
    results.append((PROMPTS[0], None, r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]))

    # /metrics adds up: 41 completed, 1 cancelled, and the tokens of each.
    after = metrics(url)

    def diff(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    done = sum(diff(f'dflash_requests_total{{endpoint="{e}",outcome="completed"}}') for e in ("chat", "completions"))
    assert done == 41
    assert diff('dflash_requests_total{endpoint="completions",outcome="cancelled"}') == 1
    generated = sum(n for *_, n in results)
    cancelled_tokens = diff("dflash_generation_tokens_total") - generated
    assert 0 <= cancelled_tokens < 400  # the one that left stopped early
    prompt_tokens = sum(p for _, _, p, _ in results)
    fed = diff('dflash_prompt_tokens_total{source="reused"}') + diff('dflash_prompt_tokens_total{source="prefilled"}')
    assert prompt_tokens < fed <= prompt_tokens + 10  # + the prompt of the one that left
    assert diff("dflash_request_seconds_count") == 42
    assert "waits:" in log.read_text()  # a request that waited said so
    assert "stopped: client gone" in log.read_text()


# -- bad requests: one 4xx JSON error each ----------------------------------------------


def check_error(r: httpx.Response, status: int, param: str | None = None, words: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    assert re.search(words, err["message"]), err
    return err


def chat_body(model, **kw):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def test_malformed_json(server):
    check_error(post(server[0], "/v1/chat/completions", b'{"model": "x", "messages": ['), 400, words="not valid JSON")


@pytest.mark.parametrize("field,value", [("max_tokens", "ten"), ("messages", "hi"), ("temperature", "hot"),
                                         ("stream", "yes"), ("stop", 5), ("seed", 1.5), ("seed", -1),
                                         ("stop", ["x"] * 17), ("top_p", 0)])
def test_wrong_types(server, model, field, value):
    check_error(post(server[0], "/v1/chat/completions", chat_body(model, **{field: value})), 400, field)


def test_wrong_type_inside_a_message(server, model):
    body = chat_body(model, messages=[{"role": "user", "content": 42}])
    err = check_error(post(server[0], "/v1/chat/completions", body), 400)
    assert err["param"].startswith("messages.0.content")


@pytest.mark.parametrize("value", [-1, 0])
def test_max_tokens_below_one(server, model, value):
    check_error(post(server[0], "/v1/completions", {"model": model, "prompt": "a", "max_tokens": value}),
                400, "max_tokens")


def test_max_tokens_huge(server, model):
    check_error(post(server[0], "/v1/chat/completions", chat_body(model, max_tokens=10**9)), 400, "max_tokens",
                "context of 512 tokens")
    check_error(post(server[0], "/v1/chat/completions", chat_body(model, max_completion_tokens=10**9)), 400,
                "max_completion_tokens")


def test_empty_messages(server, model):
    check_error(post(server[0], "/v1/chat/completions", chat_body(model, messages=[])), 400, "messages")


def test_missing_api_key(server, model):
    err = check_error(post(server[0], "/v1/chat/completions", chat_body(model), key=None), 401, words="no API key")
    assert err["code"] == "invalid_api_key"


def test_wrong_api_key(server, model):
    r = post(server[0], "/v1/chat/completions", chat_body(model), key="nope")
    assert check_error(r, 401, words="wrong API key")["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    check_error(httpx.get(f"{server[0]}/metrics"), 401)


def test_body_over_the_cap(server, model):
    body = chat_body(model, messages=[{"role": "user", "content": "a" * 20_000}])
    assert check_error(post(server[0], "/v1/chat/completions", body), 413)["code"] == "request_too_large"
    chunked = (json.dumps(body)[i : i + 1000].encode() for i in range(0, 21_000, 1000))  # no Content-Length
    assert check_error(post(server[0], "/v1/chat/completions", chunked), 413)["code"] == "request_too_large"


def test_unknown_model(server):
    err = check_error(post(server[0], "/v1/chat/completions", chat_body("gpt-4o")), 404, "model", "not served")
    assert err["code"] == "model_not_found"


def test_any_spelling_of_the_served_folder(server, model, tmp_path):
    """As mlx_lm.server: `model` may name the folder the server was started with in any
    spelling (the server runs in this test's working directory)."""
    link = tmp_path / "link"
    link.symlink_to(model)
    relative = os.path.relpath(model)
    spellings = [model + "/", relative, "./" + relative, f"~/{os.path.relpath(model, os.path.expanduser('~'))}",
                 str(link), Path(model).name]
    for name in spellings:
        r = post(server[0], "/v1/completions", {"model": name, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200, (name, r.text)
    for name in (model + "-other", str(tmp_path), "bad\x00name"):
        err = check_error(post(server[0], "/v1/completions", {"model": name, "prompt": "Once"}), 404, "model")
        assert err["code"] == "model_not_found"


def test_prompt_past_the_context(server, model):
    ids = [3 + i % 500 for i in range(600)]
    err = check_error(post(server[0], "/v1/completions", {"model": model, "prompt": ids}),
                      400, "prompt", "context is 512 tokens")
    assert err["code"] == "context_length_exceeded"


def test_other_bad_requests(server, model):
    url = server[0]
    check_error(post(url, "/v1/completions", {"model": model, "prompt": ["a", "b"]}), 400, "prompt", "one prompt")
    check_error(post(url, "/v1/completions", {"model": model, "prompt": ""}), 400, "prompt", "empty")
    check_error(post(url, "/v1/chat/completions", chat_body(model, n=2)), 400, "n")
    check_error(post(url, "/v1/chat/completions", chat_body(model, tools=[{"type": "function", "function": {"name": "f"}}])),
                400, "tools", "no chat template")
    check_error(post(url, "/v1/chat/completions", []), 400)
    check_error(httpx.get(f"{url}/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"}), 404)
    check_error(httpx.get(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)


# -- a second server: plain decoding, no queue ----------------------------------------------


def send_at_once(url, body, count, timeout=120):
    """``count`` completions of ``body`` sent together (a barrier); their status codes.
    Each 429 must be the one-line "busy" error."""
    start, codes = threading.Barrier(count), []

    def send():
        start.wait()
        r = post(url, "/v1/completions", body, key=None)
        codes.append(r.status_code)
        if r.status_code == 429:
            check_error(r, 429, words="busy")

    threads = [threading.Thread(target=send) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return codes


def test_plain_server_says_why_and_refuses_past_its_queue(stories, tmp_path):
    """Without a drafter, usage says speculation did not run and why. With --max-queue 0,
    requests that arrive while one runs get a 429: of 4 sent at once (each a few hundred
    ms of decoding), one runs and the others are refused (one at a time: --max-batch 1;
    tests/test_server_batch_live.py has the batching server's bound)."""
    with live_server(tmp_path / "serve.log", "--model", str(stories), "--max-queue", "0", "--max-batch", "1") as url:
        model = str(stories)
        r = post(url, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 4}, key=None).json()
        assert r["usage"]["dflash"]["speculative"] is False
        assert "no drafter" in r["usage"]["dflash"]["reason"]
        codes = send_at_once(url, {"model": model, "prompt": PROMPTS[0], "max_tokens": 400}, 4)
        assert sorted(codes)[0] == 200 and 429 in codes and set(codes) == {200, 429}, codes
        m = metrics(url)
        assert m['dflash_requests_total{endpoint="completions",outcome="rejected"}'] == codes.count(429)


def test_one_at_a_time_copies_from_the_ids_its_kept_caches_hold(stories, tmp_path):
    """--max-batch 1: a prompt the kept caches already hold is still context to copy from: the same request
    twice drafts the same copies (the second reusing the first's caches), and the same text."""
    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One "
             "day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily\nOnce upon a time")
    with live_server(tmp_path / "serve.log", "--model", str(stories), "--max-batch", "1") as url:
        body = {"model": str(stories), "prompt": story, "max_tokens": 60}
        runs = [post(url, "/v1/completions", body, key=None).json() for _ in range(2)]
    usage = [r["usage"] for r in runs]
    assert usage[1]["dflash"]["prompt_tokens_reused"] > usage[0]["dflash"]["prompt_tokens_reused"]
    assert usage[0]["dflash"]["prompt_lookup"] == usage[1]["dflash"]["prompt_lookup"], usage
    assert usage[0]["dflash"]["prompt_lookup"]["drafted"] > 0
    assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"]


def test_usage_figures_are_generates_for_the_same_request(stories, tmp_path):
    """A request's ``usage.dflash`` against `dflash generate --json` on the same prompt (the shipped drafter, a
    fixed block size): the figures no clock moves are equal (tokens, steps, tau, histogram, widths) and the
    peak memory within 10% (or the 1 MB both are rounded to). Rates are for benchmarks, not tests."""
    drafter, prompt = str(ROOT / "examples" / "stories260K" / "drafter"), "Once upon a time"
    with live_server(tmp_path / "serve.log", "--model", str(stories), "--draft-model", drafter, "--max-batch", "1",
                     "--block-size", "8") as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": str(stories), "prompt": prompt, "max_tokens": 64,
                                                      "temperature": 0}, timeout=120)
    served = r.json()["usage"]["dflash"]
    g = dflash("generate", "--model", str(stories), "--draft-model", drafter, "-p", prompt, "-m", "64",
               "--block-size", "8", "--ignore-chat-template", "--json", "--quiet", text=True)
    ran = json.loads(g.stdout)
    assert served["steps"] > 3 and served["tau"] > 1.0  # the drafter drafts: the figures say something
    for name in ("generation_tokens", "steps", "tau", "acceptance_histogram", "widths"):
        assert served[name] == ran[name], name
    assert served["peak_memory"] > 0 and abs(served["peak_memory"] - ran["peak_memory"]) <= max(
        0.1 * ran["peak_memory"], 0.001)
