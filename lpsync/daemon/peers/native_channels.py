"""The sockets armed plans cross nodes on: per job, one TCP connection to every other node.

The native engine (lpsync/native/net.c) sends and receives an armed plan's messages on
sockets of its own, apart from the peer mesh (whose reader threads own theirs). This
daemon listens for them on an ephemeral port of its peer address, offered in the
agreement summaries (collectives/across.py); a job's lower node dials the higher one.
Every connection is authenticated with the cluster secret (transport/auth.py: the same
handshake as the mesh's, the daemon ranks bound into it) and then names its job and the
dialling node; the acceptor files it until the job's arming asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time

from lpsync.errors import LpsyncError
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.auth import authenticate_client_socket, authenticate_server_socket

log = logging.getLogger("lpsync.native")

_HELLO = struct.Struct("<IH")  # the dialling node (of the job), the job name's length
_HANDSHAKE_SECONDS = 5.0
_KEPT = 1024  # connections filed and not yet asked for, at most (oldest dropped)


class NativeChannels:
    """This daemon's listener for armed plans' connections, and its dialler."""

    def __init__(self, address: PeerAddress, secret: bytes, rank: int) -> None:
        self.secret, self.rank = secret, rank
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address.host, 0))
        self._listener.listen(64)
        self.address = PeerAddress(address.host, self._listener.getsockname()[1])
        self._filed: dict[tuple[str, int], socket.socket] = {}  # (job, dialling node) -> socket
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="lpsync-native-accept", daemon=True)
        self._thread.start()

    def dial(self, job: str, node: int, address: PeerAddress, daemon: int, deadline: float) -> socket.socket:
        """A connection for ``job`` from this node (``node`` of the job) to the daemon
        ``daemon`` at ``address``, authenticated and introduced."""
        timeout = max(0.1, deadline - time.monotonic())
        sock = socket.create_connection((address.host, address.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            authenticate_client_socket(sock, self.secret, self.rank, min(timeout, _HANDSHAKE_SECONDS), daemon)
            name = job.encode()
            sock.sendall(_HELLO.pack(node, len(name)) + name)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    def accept(self, job: str, node: int, deadline: float) -> socket.socket | None:
        """The connection ``node`` of ``job`` dialled, once it came (None by ``deadline``)."""
        with self._lock:
            while (job, node) not in self._filed:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._arrived.wait(left)
            return self._filed.pop((job, node))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            filed = list(self._filed.values())
            self._filed.clear()
            self._arrived.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in filed:
            sock.close()
        self._thread.join(5.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            # Each handshake on a thread of its own: a silent dialler holds up no one.
            threading.Thread(target=self._introduce, args=(sock,), daemon=True).start()

    def _introduce(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_HANDSHAKE_SECONDS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            authenticate_server_socket(sock, self.secret, self.rank, _HANDSHAKE_SECONDS)
            node, length = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
            job = _recv_exact(sock, length).decode()
            sock.settimeout(None)
        except (OSError, LpsyncError, UnicodeDecodeError, struct.error) as error:
            log.warning("a native channel was refused: %s", error)
            sock.close()
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            old = self._filed.pop((job, node), None)
            if old is not None:
                old.close()  # dialled again (a retry): the newer one counts
            if len(self._filed) >= _KEPT:
                oldest = next(iter(self._filed))
                self._filed.pop(oldest).close()
            self._filed[(job, node)] = sock
            self._arrived.notify_all()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("the connection closed during its introduction")
        data += chunk
    return data
