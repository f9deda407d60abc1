"""Start and stop of ``dflash serve``: the listening socket, taken before the model
loads, and a uvicorn server that ends the engine's work when it is told to stop.

- :func:`listen`: ``--host``/``--port`` checked by binding them (a port in use, a host
  this machine does not have: one-line errors), before anything slow runs. The socket
  listens from then on, so the port stays ours; connections made while the model
  loads wait in its backlog and are answered once it is ready.
- :func:`serve`: uvicorn on that socket until SIGINT (Ctrl-C) or SIGTERM. At the
  signal, requests in flight stop after their current step (a 503, or an error event
  for a stream) instead of running to their end, so the server stops within a step
  or two (a second Ctrl-C does not cut that short); the engine's worker thread has
  ended, and released what MLX keeps for it (:func:`release_streams`), before
  :func:`serve` returns.
- :func:`release_streams`: what a thread that ran MLX work does last.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

from ..atomic import sigterm_as_interrupt
from ..errors import InputError

log = logging.getLogger("dflash.serve")

BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, as uvicorn would bind it
    (IPv6 for a host with a colon; SO_REUSEADDR, so a port whose last connections are
    in TIME_WAIT is taken, and one another server listens on is not).

    Raises:
        InputError: the port is in use or not allowed, or the host is not an address
            of this machine (naming ``--port`` or ``--host``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except socket.gaierror as e:
        sock.close()
        raise InputError(f"--host {host}: not a host name or address this machine can listen on "
                         f"({e.strerror})") from None
    except OSError as e:
        sock.close()
        raise InputError(_bind_error(host, port, e)) from None
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use (--port): another server listens there; pick another port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    if e.errno == errno.EACCES:
        return f"--port {port}: not allowed ({e.strerror}); ports below 1024 need privileges"
    return f"cannot listen on {host} port {port} (--host, --port): {e.strerror or e}"


def serve(app: Any, sock: socket.socket, engine: Any, **config: Any) -> None:
    """Run uvicorn with ``app`` on ``sock`` until a stop signal; return once the
    engine's worker has ended.

    Args:
        engine: the app's :class:`~dflash_mlx.serve.engine.Engine`; shut down at the
            signal and waited for at the end, however uvicorn ended.
        config: ``uvicorn.Config`` settings (log_level, timeout_keep_alive, ...).
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # A second Ctrl-C would skip the app's shutdown (a CancelledError traceback);
            # the first one already stops the work in flight within a step.
            self.force_exit = False

        async def shutdown(self, sockets=None) -> None:
            engine.shutdown()  # requests in flight end after their step; uvicorn then waits for them
            await super().shutdown(sockets)

    host, port = sock.getsockname()[:2]
    server = Server(uvicorn.Config(app, host=host, port=port, **config))
    try:
        with sigterm_as_interrupt():  # else uvicorn's SIGTERM, delivered again, would kill the process
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # the stop signal, delivered again by uvicorn once it has stopped
        pass
    finally:
        engine.shutdown(wait=True)
        sock.close()


def release_streams() -> None:
    """End the calling thread's MLX work: wait for its stream, then free what MLX keeps
    per thread (streams, compiled functions' cache, random key). Call it last on a
    worker thread. Left to the thread's exit, the compile cache and the random key are
    freed under the GIL; once the interpreter is finishing, taking the GIL ends the
    thread inside that C++ destructor and the process aborts ("terminate called without
    an active exception")."""
    import mlx.core as mx

    try:
        mx.synchronize()
    except RuntimeError as e:  # a failed evaluation on this stream: it is being released anyway
        log.warning("the engine's MLX stream failed at shutdown: %s", e)
    mx.clear_streams()
