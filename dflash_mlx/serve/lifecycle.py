"""Start and stop of ``dflash serve``: the socket (taken before the model loads), uvicorn until SIGINT or SIGTERM."""

import errno
import logging
import socket
from contextlib import suppress
from typing import Any

from ..atomic import sigterm_as_interrupt
from ..errors import InputError

log = logging.getLogger("dflash.serve")

BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (SO_REUSEADDR).

    Raises:
        InputError: naming ``--port`` (in use, not allowed) or ``--host`` (not an address of this machine).
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
    """Run uvicorn with ``app`` on ``sock`` until a stop signal; return once ``engine``'s worker has ended."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.force_exit = False  # a second Ctrl-C must not skip the app's shutdown

        async def shutdown(self, sockets=None) -> None:
            engine.shutdown()  # requests in flight end after their step; uvicorn then waits for them
            await super().shutdown(sockets)

    host, port = sock.getsockname()[:2]
    server = Server(uvicorn.Config(app, host=host, port=port, **config))
    try:  # uvicorn delivers the stop signal again once it has stopped: SIGTERM too must end here, not kill
        with suppress(KeyboardInterrupt), sigterm_as_interrupt():
            server.run(sockets=[sock])
    finally:
        engine.shutdown(wait=True)
        sock.close()


def release_streams() -> None:
    """Synchronize and free the calling thread's MLX streams; call it last on a worker thread."""
    import mlx.core as mx

    try:
        mx.synchronize()
    except RuntimeError as e:  # a failed evaluation on this stream: it is being released anyway
        log.warning("the engine's MLX stream failed at shutdown: %s", e)
    mx.clear_streams()
