"""`dflash serve` stops cleanly and refuses a port it cannot have, before loading anything.

A live server (stories260K with a random drafter) serves 4 requests, then gets SIGINT
(Ctrl-C) or SIGTERM: while idle, or with a stream and a batch of requests in flight
(batched, the default, and --max-batch 1). It exits 0 or 130 with no C++ abort
("terminate called ...") and no traceback; the requests in flight end (a finished
reply or "the server is shutting down"), none hangs. Each signal goes to a server that
answers /health and is still running when it is sent, so a server that had already
ended, or a signal that never arrived, fails the test.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading

import pytest

from conftest import dflash, free_port, needs_shared, openai_client, start_server
from dflash_mlx.errors import InputError
from dflash_mlx.serve.lifecycle import listen
from test_server import PROMPTS

openai = pytest.importorskip("openai")

LONG = 480  # tokens of the requests in flight at the signal: most of stories260K's 512 context


def four_requests(url: str, model: str) -> None:
    """4 requests at once (batched where the server batches), each answered in full."""
    replies = [None] * 4

    def one(i: int) -> None:
        replies[i] = openai_client(url).completions.create(model=model, prompt=PROMPTS[i], max_tokens=16)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and r.choices[0].finish_reason in ("length", "stop") for r in replies), replies


class InFlight:
    """A stream and a plain request, running when the signal comes; each records how it
    ended: "finished", "shutting down" (the server's 503 or error event), or the error."""

    def __init__(self, url: str, model: str):
        self.url, self.model, self.ends = url, model, {}
        self.streaming = threading.Event()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._plain)]
        for t in self.threads:
            t.start()
        assert self.streaming.wait(timeout=300), self.ends  # its first text has come: it is in flight

    def _ended(self, name: str, body) -> None:
        self.ends[name] = body

    def _stream(self) -> None:
        try:
            finish = None
            for chunk in openai_client(self.url).completions.create(model=self.model, prompt=PROMPTS[0],
                                                             max_tokens=LONG, stream=True):
                self.streaming.set()
                finish = chunk.choices[0].finish_reason or finish
            self._ended("stream", "finished" if finish else "no finish_reason")
        except openai.APIError as e:
            self._ended("stream", "shutting down" if "shutting down" in str(e) else repr(e))
        finally:
            self.streaming.set()

    def _plain(self) -> None:
        try:
            r = openai_client(self.url).completions.create(model=self.model, prompt=PROMPTS[1], max_tokens=LONG)
            self._ended("plain", "finished" if r.choices[0].finish_reason else "no finish_reason")
        except openai.APIStatusError as e:
            self._ended("plain", "shutting down" if e.status_code == 503 else repr(e))
        except openai.APITimeoutError as e:
            self._ended("plain", repr(e))
        except openai.APIConnectionError:  # it came as the server stopped: refused, or closed unanswered
            self._ended("plain", "closed")

    def ended(self) -> dict:
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), f"a request in flight hangs: {self.ends}"
        return self.ends


def stop(proc: subprocess.Popen, sig: int, log) -> str:
    """Send ``sig`` to the running server; its output once it exited 0 or 130."""
    assert proc.poll() is None, f"the server ended before the signal: {log.read_text()}"
    assert "Shutting down" not in log.read_text(), "the server was stopping before the signal"
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    out = log.read_text()
    assert proc.returncode in (0, 130), out
    assert "terminate called" not in out and "Traceback" not in out, out
    assert "Shutting down" in out, out  # uvicorn's line, written after the signal: it stopped because of it
    return out


CASES = [  # (what is running at the signal, signal, --max-batch)
    pytest.param("idle", signal.SIGINT, 8, id="idle-SIGINT-1"),
    pytest.param("idle", signal.SIGINT, 8, id="idle-SIGINT-2"),
    pytest.param("idle", signal.SIGTERM, 8, id="idle-SIGTERM"),
    pytest.param("in-flight", signal.SIGINT, 8, id="in-flight-SIGINT"),
    pytest.param("in-flight", signal.SIGTERM, 8, id="in-flight-SIGTERM"),
    pytest.param("in-flight", signal.SIGINT, 1, id="in-flight-SIGINT-max-batch-1"),
]


@needs_shared
@pytest.mark.parametrize("moment, sig, max_batch", CASES)
def test_a_stop_signal_ends_the_server_cleanly(stories, random_drafter, tmp_path, moment, sig, max_batch):
    log = tmp_path / "serve.log"
    model = str(stories)
    proc, url = start_server(log, "--model", model, "--draft-model", str(random_drafter),
                             "--max-batch", str(max_batch))
    try:
        four_requests(url, model)
        flight = InFlight(url, model) if moment == "in-flight" else None
        stop(proc, sig, log)
    finally:
        proc.kill()
    if flight is not None:
        ends = flight.ended()
        assert ends["stream"] in ("finished", "shutting down"), ends
        assert ends["plain"] in ("finished", "shutting down", "closed"), ends


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return dflash("serve", *args, text=True)


@needs_shared
def test_a_port_in_use_is_one_line_before_the_model_loads(stories):
    with socket.socket() as other:  # another server, listening
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = run_serve("--model", str(stories), "--port", str(port))
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"error: port {port} on 127.0.0.1 is in use (--port): another server "
                                     "listens there; pick another port"], r.stderr
    assert r.stdout == ""


@needs_shared
def test_a_host_not_on_this_machine_is_one_line(stories):
    r = run_serve("--model", str(stories), "--host", "192.0.2.1", "--port", str(free_port()))  # TEST-NET-1
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == ["error: --host 192.0.2.1: not an address of this machine"], r.stderr


def test_a_port_in_time_wait_is_taken():
    """A port whose last connection this side closed (TIME_WAIT) is free to listen on, as
    uvicorn would; one a server listens on is not."""
    first = listen("127.0.0.1", 0)
    port = first.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port))
    accepted, _ = first.accept()
    accepted.close()  # this side closes first: its end of the connection waits in TIME_WAIT
    assert peer.recv(1) == b""
    peer.close()
    first.close()
    again = listen("127.0.0.1", port)
    try:
        with pytest.raises(InputError, match=f"port {port} on 127.0.0.1 is in use"):
            listen("127.0.0.1", port)
    finally:
        again.close()
