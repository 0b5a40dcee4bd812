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

Bounds (docs/reliability.md): at most ``max_sessions`` connections at once (more are
answered RESOURCE_EXHAUSTED and closed); a connection must send its open packet within
OPEN_TIMEOUT; a packet that is not a SessionRequest closes the connection. Before closing
for a reason the daemon sends one last packet, a SessionResponse with request_id 0 and a
CollectiveResult carrying the code and message: the client fails what it waits for with
that error. Replies are sent without blocking (they may come from the event loop): what the
socket does not take waits in the connection's outbox; while max_queued replies wait, the
client's requests are not read (back-pressure), so a client that stops reading blocks in its
own sends, and the daemon holds at most max_queued + max_pending replies for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
from collections import deque
from pathlib import Path

from lpsync.daemon.control.handlers import Service
from lpsync.errors import InvalidArgumentError, LpsyncError, ResourceExhaustedError
from lpsync_client.wire.proto import lpsync_pb2 as pb

log = logging.getLogger("lpsync.daemon")
MAX_PACKET = 1 << 16  # requests are a few hundred bytes
OPEN_TIMEOUT = 10.0  # seconds a new connection may take to send open{session_id}


class _Closed(Exception):
    """This connection ends now (a reason was sent to the client, or it is gone)."""


def _reason(error: LpsyncError, request_id: int = 0) -> pb.SessionResponse:
    return pb.SessionResponse(
        request_id=request_id,
        result=pb.CollectiveResult(code=error.code, message=str(error), error=type(error).__name__),
    )


def _parse(data: bytes) -> pb.SessionRequest:
    try:
        return pb.SessionRequest.FromString(data)
    except Exception as error:  # DecodeError and friends: the bytes are not a request
        raise InvalidArgumentError(
            f"a {len(data)}-byte packet on the trigger socket is not a SessionRequest "
            f"({error or 'malformed protobuf'}); closing this connection"
        ) from None


class _Outbox:
    """Replies of one connection. ``reply`` may run on any thread (the gRPC event loop
    included), so it never blocks: it sends at once when the socket takes it, else queues
    the reply and wakes the connection's reader, which sends the queue when the socket is
    writable again."""

    def __init__(self, conn: socket.socket, limit: int) -> None:
        self.conn, self.limit = conn, limit
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.broken = False
        self._lock = threading.Lock()
        self.queue: deque[bytes] = deque()  # replies the socket did not take yet

    def reply(self, response: pb.SessionResponse) -> None:
        self.reply_bytes(response.SerializeToString())

    def reply_bytes(self, data: bytes) -> None:
        """A reply serialized already (a collective's result: replies.result_bytes)."""
        with self._lock:
            if self.broken:
                return
            if (not self.queue and self._send(data)) or self.broken:
                return
            if len(self.queue) >= self.limit:
                log.warning(
                    "trigger client does not read its replies; disconnecting it",
                    extra={"held": len(self.queue)},
                )
                self._break()
                return
            self.queue.append(data)
        with contextlib.suppress(OSError):
            os.eventfd_write(self.wake, 1)

    def flush(self) -> None:
        with self._lock:
            while self.queue and not self.broken and self._send(self.queue[0]):
                self.queue.popleft()

    def _send(self, data: bytes) -> bool:
        """Whether it was sent (False: the socket is full, or broken). Lock held."""
        try:
            self.conn.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:  # the client is gone: its gRPC stream says so
            self._break()
            return False
        return True

    def _break(self) -> None:
        self.broken = True
        self.queue.clear()
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self.broken = True
            self.queue.clear()
        os.close(self.wake)


class TriggerServer:
    def __init__(self, path: Path, service: Service) -> None:
        self.path, self.service = path, service
        self._stopping = False  # a flag, not an Event: each request's loop reads it without a call
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._slots = threading.BoundedSemaphore(service.state.limits.max_sessions)

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
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="lpsync-trigger-conn", daemon=True
            )
            thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        error = ResourceExhaustedError(
            "the trigger socket serves at most --max-sessions "
            f"({self.service.state.limits.max_sessions}) connections at once"
        )
        with conn, contextlib.suppress(OSError):
            conn.send(_reason(error).SerializeToString(), socket.MSG_DONTWAIT)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        limits = self.service.state.limits
        # Never more replies held than reads allowed plus every collective the job may
        # have pending: a client can only exceed it by breaking the protocol.
        out = _Outbox(conn, limits.max_queued + limits.max_pending)
        try:
            session = self._open(conn, out.reply)
            # Non-blocking from here on (select waits): with a timeout set, Python would
            # wait out the timeout on a full socket even for MSG_DONTWAIT.
            conn.setblocking(False)
            from_string = pb.SessionRequest.FromString
            while not self._stopping and not session.ended and not out.broken:
                # Back-pressure: while max_queued replies wait for the client, its requests
                # are not read; they back up in its socket and its sends block.
                held = len(out.queue)
                reading: list[socket.socket | int]
                reading = [conn, out.wake] if held < limits.max_queued else [out.wake]
                readable, writable, _ = select.select(reading, [conn] if held else [], [], 1.0)
                if out.wake in readable:
                    os.eventfd_read(out.wake)
                if writable:
                    out.flush()
                if conn not in readable:
                    continue
                data = conn.recv(MAX_PACKET)
                if not data:
                    return  # the client closed it
                try:  # _parse inline: one Python call less per request
                    request = from_string(data)
                except Exception:  # not a request: _parse says why
                    request = _parse(data)
                self.service.handle(session, request, out.reply, out.reply_bytes)
        except _Closed:
            pass
        except LpsyncError as error:  # a malformed packet: say why, then close
            log.info("trigger connection refused", extra={"reason": str(error)})
            out.reply(_reason(error))
            out.flush()
        except OSError as error:
            log.debug("trigger connection closed", extra={"error": repr(error)})
        finally:
            out.close()
            # The slot first: a client that sees this connection close may connect again
            # at once, and must find it free.
            self._slots.release()
            conn.close()

    def _open(self, conn: socket.socket, reply):
        waited = 0.0
        while True:
            if self._stopping:
                raise _Closed
            try:
                data = conn.recv(MAX_PACKET)
                break
            except TimeoutError:
                waited += conn.gettimeout() or 1.0
                if waited >= OPEN_TIMEOUT:
                    reply(
                        _reason(
                            InvalidArgumentError(f"no open{{session_id}} packet within {OPEN_TIMEOUT:g} s")
                        )
                    )
                    raise _Closed from None
        if not data:
            raise _Closed
        first = _parse(data)
        try:
            if first.WhichOneof("body") != "open":
                raise InvalidArgumentError("the first packet must be open{session_id}")
            session = self.service.state.sessions.get(first.open.session_id)
            if not session.stream_bound:
                raise InvalidArgumentError("open the gRPC Session stream first; it is the lifeline")
        except LpsyncError as error:
            log.warning(
                "trigger socket: refused a connection",
                extra={"peer": _peer(conn), "error": f"{type(error).__name__}: {error}"},
            )
            reply(_reason(error, first.request_id))
            raise _Closed from None
        reply(pb.SessionResponse(request_id=first.request_id, opened=first.open))
        return session

    def stop(self) -> None:
        self._stopping = True
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
        pid, uid, gid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
    except OSError:
        return "?"
    return f"pid {pid} uid {uid} gid {gid}"
