"""Fuzzing `dflash serve`'s request schema: every hostile body gets a 2xx or a 4xx with
OpenAI's JSON error, never a 5xx (tiny random pair, in-process; derandomized, so a
failure reproduces)."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from request_fuzz import hostile_request  # noqa: E402
from test_server_limits import MODEL, make_client, tiny_pair  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with make_client(tiny_pair()) as c:
        yield c


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=hostile_request(MODEL))
def test_hostile_requests_get_2xx_or_4xx(client, request):
    path, body = request
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in r.text
        assert "\n" not in err["message"]
