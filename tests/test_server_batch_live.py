"""`dflash serve` with continuous batching (the default --max-batch 8), end to end on
stories260K with a drafter: 8 concurrent openai clients, streaming or not, chat and
completions, each reply equal to `dflash generate`; a client that leaves mid-stream
is counted cancelled and affects no other reply; /metrics says batching is on and
gives the batch size, queue waits and per-request tau; the hardened limits (API key,
body cap, context) still answer 4xx."""

from __future__ import annotations

import threading

import httpx
import pytest

from conftest import needs_shared
from test_server import KEY, N, PROMPTS, check_error, live_server, metrics, post, reference, send_at_once  # noqa: F401

openai = pytest.importorskip("openai")

pytestmark = needs_shared


@pytest.fixture(scope="module")
def server(stories, random_drafter, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-batch") / "serve.log"
    with live_server(log, "--model", str(stories), "--draft-model", str(random_drafter), "--api-key", KEY,
                     "--max-body-mb", str(10_000 / 2**20), "--block-size", "8", "--log-level", "info") as url:
        yield url, log


@pytest.fixture(scope="module")
def model(stories):
    return str(stories)


def one(url: str, model: str, prompt: str, stream: bool, chat: bool):
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    if chat:
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                      max_tokens=N, stream=stream)
        if stream:
            return "".join(x.choices[0].delta.content or "" for x in r if x.choices)
        return r.choices[0].message.content
    r = c.completions.create(model=model, prompt=prompt, max_tokens=N, stream=stream)
    if stream:
        return "".join(x.choices[0].text for x in r if x.choices)
    return r.choices[0].text


def test_8_clients_equal_dflash_generate_and_a_disconnect(server, model, reference):  # noqa: F811
    url, log = server
    before = metrics(url)
    results, errors, left = [], [], []

    def client_loop(i: int):
        try:
            for k in range(3):
                prompt = PROMPTS[(i + k) % len(PROMPTS)]
                results.append((prompt, one(url, model, prompt, (i + k) % 2 == 0, (i * 3 + k) % 3 != 0)))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

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
    threads.append(threading.Thread(target=leave_mid_stream))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(results) == 24 and len(left) == 3
    for prompt, text in results:
        assert text == reference(prompt), prompt
    after = metrics(url)
    assert after["dflash_batching"] == 1.0
    assert after["dflash_batch_size"] == 0  # every request has finished
    assert after["dflash_queue_wait_seconds_count"] - before.get("dflash_queue_wait_seconds_count", 0) == 25
    assert after["dflash_request_tau_count"] - before.get("dflash_request_tau_count", 0) >= 24
    done = sum(after.get(f'dflash_requests_total{{endpoint="{e}",outcome="completed"}}', 0)
               - before.get(f'dflash_requests_total{{endpoint="{e}",outcome="completed"}}', 0)
               for e in ("chat", "completions"))
    assert done == 24
    assert after['dflash_requests_total{endpoint="completions",outcome="cancelled"}'] == 1
    text = log.read_text()
    assert "continuous batching: up to 8 requests" in text and "stopped: client gone" in text


def test_limits_hold_with_batching(server, model):
    url, _ = server
    check_error(post(url, "/v1/completions", {"model": model, "prompt": "a"}, key=None), 401)
    check_error(post(url, "/v1/completions", {"model": model, "prompt": "x" * 20_000}), 413)
    check_error(post(url, "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 0}), 400, "max_tokens")
    check_error(post(url, "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 10**9}), 400,
                "max_tokens")
    r = post(url, "/v1/completions", {"model": model, "prompt": "Once", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_plain_batching_server_says_why_and_bounds_its_queue(stories, tmp_path):
    """Without a drafter, batched usage says speculation did not run and why. With
    --max-batch 2 --max-queue 0, of 5 requests sent at once (each a few hundred ms of
    decoding) two run together and the others get a 429."""
    with live_server(tmp_path / "serve.log", "--model", str(stories), "--max-queue", "0", "--max-batch", "2") as url:
        model = str(stories)
        r = post(url, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 4}, key=None).json()
        assert r["usage"]["dflash"]["speculative"] is False and "no drafter" in r["usage"]["dflash"]["reason"]
        codes = send_at_once(url, {"model": model, "prompt": PROMPTS[0], "max_tokens": 400}, 5)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) == {200, 429}, codes
        m = metrics(url)
        assert m["dflash_batching"] == 1.0
        assert m['dflash_requests_total{endpoint="completions",outcome="rejected"}'] == codes.count(429)
