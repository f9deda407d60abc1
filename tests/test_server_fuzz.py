"""Fuzzing `dflash serve`'s request schema: every hostile body gets a 2xx or a 4xx with
OpenAI's JSON error, never a 5xx, and the process's memory stays bounded (tiny random
pair, in-process; derandomized, so a failure reproduces)."""

from __future__ import annotations

from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from request_fuzz import hostile_request  # noqa: E402
from conftest import SERVED as MODEL, app_client, tiny_server_pair  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with app_client(tiny_server_pair()) as c:
        yield c


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def memory(client):
    """RSS before the fuzzing (Linux; 0 elsewhere), checked after it by the last test."""
    client.post("/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 2})
    return rss_mb()


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=hostile_request(MODEL))
def test_hostile_requests_get_2xx_or_4xx(client, memory, request):
    path, body = request
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in r.text
        assert "\n" not in err["message"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_memory_stays_bounded(memory):
    """A request that ran a template or tokenized a huge prompt would add hundreds of MB
    (2 GB for the template of issue 23); 300 hostile requests add little."""
    assert rss_mb() - memory < 200, (memory, rss_mb())
