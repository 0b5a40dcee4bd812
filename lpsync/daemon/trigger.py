"""The trigger socket: the Session protocol without gRPC, for the lowest latency.

A Unix SOCK_SEQPACKET socket next to the gRPC one (``<socket>.trigger``, mode 0660).
Each packet is one serialized SessionRequest (client -> daemon) or SessionResponse
(daemon -> client); the first request is open{session_id}, naming a session that
already has its gRPC Session stream (that stream stays the session's lifeline and the
session id, obtained through the authenticated gRPC Attach, is the credential here).

Why it is faster: a client sends from its calling thread and the daemon replies from
the thread that completes the collective (the last arrival's reader), so a small
collective crosses no thread hand-off inside the daemon and one in the client, where
the gRPC stream crosses several and HTTP/2 framing.

Threads: one accept thread, one reader per connection. Every wait has a timeout (the
sockets' 1 s timeouts), so stop() ends them all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from lpsync._proto import lpsync_pb2 as pb
from lpsync.daemon.servicer import Service
from lpsync.errors import LpsyncError

log = logging.getLogger("lpsync.daemon")
MAX_PACKET = 1 << 16  # requests are a few hundred bytes


class TriggerServer:
    def __init__(self, path: Path, service: Service) -> None:
        self.path, self.service = path, service
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # our own socket's sibling: stale if present
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o117)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o660)
        listener.listen(64)
        listener.settimeout(1.0)
        self._listener = listener
        thread = threading.Thread(target=self._accept, name="lpsync-trigger", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            thread = threading.Thread(target=self._serve, args=(conn,),
                                      name="lpsync-trigger-conn", daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        lock = threading.Lock()  # several completing threads may reply at once

        def reply(response: pb.SessionResponse) -> None:
            data = response.SerializeToString()
            with lock, contextlib.suppress(OSError):  # the client is gone: its stream says so
                conn.sendall(data)

        try:
            session = self._open(conn, reply)
            if session is None:
                return
            while not self._stop.is_set() and not session.ended:
                try:
                    data = conn.recv(MAX_PACKET)
                except TimeoutError:
                    continue
                if not data:
                    return  # the client closed it
                self.service.handle(session, pb.SessionRequest.FromString(data), reply)
        except (OSError, ValueError) as error:  # ValueError: a packet that does not parse
            log.debug("trigger connection closed", extra={"error": repr(error)})
        finally:
            conn.close()

    def _open(self, conn: socket.socket, reply):
        while not self._stop.is_set():
            try:
                data = conn.recv(MAX_PACKET)
                break
            except TimeoutError:
                continue
        else:
            return None
        first = pb.SessionRequest.FromString(data) if data else pb.SessionRequest()
        try:
            if first.WhichOneof("body") != "open":
                raise LpsyncError("the first packet must be open{session_id}")
            session = self.service.sessions.get(first.open.session_id)
            if not session.stream_bound:
                raise LpsyncError("open the gRPC Session stream first; it is the lifeline")
        except LpsyncError as error:
            log.warning("trigger socket: refused a connection", extra={
                "peer": _peer(conn), "error": f"{type(error).__name__}: {error}"})
            reply(pb.SessionResponse(request_id=first.request_id, result=pb.CollectiveResult(
                code=error.code, message=str(error), error=type(error).__name__)))
            return None
        reply(pb.SessionResponse(request_id=first.request_id, opened=first.open))
        return session

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


def _peer(conn: socket.socket) -> str:
    """Who is at the other end (SO_PEERCRED), for the log. Not a check: the socket's mode
    already admits only the daemon's user and group, and inside the group the session id
    (from an authenticated Attach) is the credential (docs/security.md)."""
    try:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
    except OSError:
        return "?"
    return f"pid {pid} uid {uid} gid {gid}"
