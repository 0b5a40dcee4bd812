"""The trigger socket: the Session protocol over a Unix SOCK_SEQPACKET socket, no gRPC.

Same messages and the same Future-based API as the gRPC SessionStream; requests leave
from the calling thread (no hand-off), one reader thread completes the Futures. The
gRPC Session stream stays open beside it: it is how the daemon learns this client is
gone. Every wait has a timeout (the socket's 1 s timeout, checked against close()).
"""

from __future__ import annotations

import contextlib
import socket
import threading

from lpsync_client._pending import Call, Hook, PendingRequests
from lpsync_client._proto import lpsync_pb2 as pb
from lpsync_client.errors import LpsyncError, UnavailableError, from_status

MAX_PACKET = 1 << 16


class TriggerStream:
    def __init__(self, path: str, session_id: str, open_timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(open_timeout)
        try:
            self._sock.connect(path)
            self._sock.sendall(
                pb.SessionRequest(open=pb.SessionOpen(session_id=session_id)).SerializeToString()
            )
            first = pb.SessionResponse.FromString(self._sock.recv(MAX_PACKET))
        except OSError as error:
            self._sock.close()
            raise UnavailableError(f"cannot open the trigger socket {path}: {error}") from None
        if first.WhichOneof("body") != "opened":
            self._sock.close()
            r = first.result
            raise from_status(r.code or "UNAVAILABLE", r.message or "trigger socket refused", r.error)
        self._sock.settimeout(1.0)
        self._pending = PendingRequests("trigger socket")
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="lpsync-client-trigger", daemon=True)
        self._reader.start()

    def submit(self, request: pb.SessionRequest, hook: Hook) -> Call:
        return self._pending.submit(request, hook, self._send)

    def _send(self, request: pb.SessionRequest) -> None:
        try:
            self._sock.sendall(request.SerializeToString())
        except OSError as error:
            raise UnavailableError(f"the trigger socket failed: {error}") from None

    def _read(self) -> None:
        error: LpsyncError = UnavailableError("the trigger socket closed")
        try:
            while not self._closing:
                try:
                    data = self._sock.recv(MAX_PACKET)
                except TimeoutError:
                    continue
                if not data:
                    break
                response = pb.SessionResponse.FromString(data)
                if response.request_id == 0 and response.WhichOneof("body") == "result":
                    # The daemon's reason for closing this connection (a malformed packet,
                    # a client that did not read its replies): every waiter gets it.
                    r = response.result
                    error = from_status(r.code or "UNAVAILABLE", r.message, r.error)
                    break
                self._pending.complete(response)
        except OSError as failure:
            error = UnavailableError(f"the trigger socket failed: {failure}")
        finally:
            self._pending.fail_all(error)

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader at once
        self._reader.join(timeout)
        self._sock.close()
