"""One process's TCP listener on its peer port, kept for the process's life.

Like the UCX runtime, it outlives the meshes built on it: a rebuild after a lost peer
only makes connections. Connections that arrive while no endpoint is forming are closed
at once; the dialling side retries.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from lpsync.errors import UnavailableError

log = logging.getLogger("lpsync.tcp")

Acceptor = Callable[[socket.socket], None]  # gets each accepted socket, on the accept thread


class TcpRuntime:
    def __init__(self, port: int) -> None:
        self.port = port
        try:
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(
                    ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
                )
            else:
                self._listener = socket.create_server(("", port), backlog=128)
        except OSError as error:
            raise UnavailableError(f"cannot listen on port {port}: {error}") from None
        self._lock = threading.Lock()
        self._acceptor: Acceptor | None = None
        self._thread = threading.Thread(target=self._accept_loop, name=f"lpsync-tcp:{port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # the listener was shut down: close() is running
                return
            with self._lock:
                acceptor = self._acceptor
            if acceptor is None:
                log.debug("port %d: closed a connection: no mesh is forming", self.port)
                sock.close()
            else:
                acceptor(sock)

    def set_acceptor(self, acceptor: Acceptor | None) -> None:
        """Route accepted sockets to ``acceptor`` (the endpoint that is forming), or close
        them (None)."""
        with self._lock:
            if acceptor is not None and self._acceptor is not None:
                raise UnavailableError("another endpoint is already forming on this runtime")
            self._acceptor = acceptor

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening. Endpoints made on it keep their connections until they close."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        self._thread.join(timeout)
        self._listener.close()

    def __enter__(self) -> TcpRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
