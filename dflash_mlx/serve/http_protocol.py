"""uvicorn's h11 protocol with more limits: headers within ``header_timeout`` s (else a close, or a 408 if some
came), a 431 past h11's header size and a 400 for bad HTTP as JSON, then :data:`LINGER_S` of draining."""

import asyncio
import json
from typing import Any, Dict, Optional

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from .api import TIMEOUT_TYPE, error_body

LINGER_S = 2.0  # most seconds an answered bad connection is read (and dropped) before it closes
PHRASES = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


class _Connection(h11.Connection):
    """h11's connection, remembering the status h11 suggests for the last protocol error."""

    error_status = 400

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise


class GuardedH11Protocol(H11Protocol):
    """The guarded protocol (module doc); :func:`guarded_protocol` sets :attr:`header_timeout`."""

    header_timeout: float = 5.0

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.max_header_bytes = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(h11.SERVER, self.max_header_bytes)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._heard = False  # bytes of the current request's headers arrived
        self._answered = False  # an error went out: what comes in now is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        if self.conn.their_state is h11.IDLE:  # waiting for a request's headers
            self._heard = True
            if self._header_timer is None:
                self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the keep-alive wait starts; a next byte arms the header timer
        self._heard = False

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._heard:  # nothing sent at all: close without a word
            self.transport.close()
            return
        body = error_body(f"the request's headers did not arrive within {self.header_timeout:g} s "
                          "(--idle-timeout)", TIMEOUT_TYPE, code="request_timeout")
        self._answer(408, body, raw=True)

    def send_400_response(self, msg: str) -> None:
        """431 for headers past the size limit, else 400, as JSON; then the linger."""
        status = 431 if self.conn.error_status == 431 else 400
        if status == 431:
            body = error_body(f"the request's headers are larger than {self.max_header_bytes} bytes", param=None,
                              code="request_header_fields_too_large")
        else:
            body = error_body("the request is not valid HTTP/1.1", code="invalid_http_request")
        self._answer(status, body, raw=False)

    def _answer(self, status: int, body: Dict[str, Any], raw: bool) -> None:
        """Send ``body`` with ``Connection: close``, then drain; ``raw``: no request parsed, h11 cannot frame it."""
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                   (b"connection", b"close")]
        if raw:
            head = f"HTTP/1.1 {status} {PHRASES[status]}\r\n".encode()
            head += b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"
            self.transport.write(head + data)
        else:
            for event in (h11.Response(status_code=status, headers=headers, reason=PHRASES[status].encode()),
                          h11.Data(data=data), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self._answered = True
        self._disarm()
        self.flow.resume_reading()
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:  # the client is gone already
            self.transport.close()
            return
        self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(header_timeout: float) -> type:
    """A :class:`GuardedH11Protocol` class whose headers time out after ``header_timeout`` s."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


def uvicorn_options(idle_timeout: float, max_connections: int) -> Dict[str, Any]:
    """uvicorn settings: ``idle_timeout`` s of keep-alive and for headers, ``max_connections`` at once (then 503)."""
    return {"http": guarded_protocol(idle_timeout), "timeout_keep_alive": idle_timeout,
            "limit_concurrency": max_connections}
