"""The trigger socket: the Session protocol over a Unix SOCK_SEQPACKET socket, no gRPC.

Same messages and the same Future-based API as the gRPC SessionStream; requests leave
from the calling thread (no hand-off), one reader thread completes the Futures. The
gRPC Session stream stays open beside it: it is how the daemon learns this client is
gone. Every wait has a timeout (the socket's 1 s timeout, checked against close()).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from concurrent.futures import Future

from lpsync_client._proto import lpsync_pb2 as pb
from lpsync_client._stream import Hook
from lpsync_client.errors import LpsyncError, UnavailableError, from_status

MAX_PACKET = 1 << 16


class TriggerStream:
    def __init__(self, path: str, session_id: str, open_timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(open_timeout)
        try:
            self._sock.connect(path)
            self._sock.sendall(pb.SessionRequest(
                open=pb.SessionOpen(session_id=session_id)).SerializeToString())
            first = pb.SessionResponse.FromString(self._sock.recv(MAX_PACKET))
        except OSError as error:
            self._sock.close()
            raise UnavailableError(f"cannot open the trigger socket {path}: {error}") from None
        if first.WhichOneof("body") != "opened":
            self._sock.close()
            r = first.result
            raise from_status(r.code or "UNAVAILABLE", r.message or "trigger socket refused",
                              r.error)
        self._sock.settimeout(1.0)
        self._pending: dict[int, tuple[Future, Hook]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._error: LpsyncError | None = None
        self._reader = threading.Thread(target=self._read, name="lpsync-client-trigger",
                                        daemon=True)
        self._reader.start()

    def submit(self, request: pb.SessionRequest, hook: Hook) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise self._error or UnavailableError("the trigger socket is closed")
            rid = next(self._ids)
            self._pending[rid] = (future, hook)
            request.request_id = rid
            # Under the lock: packets leave in submission order (sequence numbers).
            try:
                self._sock.sendall(request.SerializeToString())
            except OSError as error:
                self._pending.pop(rid, None)
                raise UnavailableError(f"the trigger socket failed: {error}") from None
        return future

    def _read(self) -> None:
        error: LpsyncError = UnavailableError("the trigger socket closed")
        try:
            while not self._closed:
                try:
                    data = self._sock.recv(MAX_PACKET)
                except TimeoutError:
                    continue
                if not data:
                    break
                response = pb.SessionResponse.FromString(data)
                with self._lock:
                    entry = self._pending.pop(response.request_id, None)
                if entry is None:
                    continue
                future, hook = entry
                try:
                    future.set_result(hook(response))
                except BaseException as failure:  # the hook's error belongs to the caller
                    future.set_exception(failure)
        except OSError as failure:
            error = UnavailableError(f"the trigger socket failed: {failure}")
        finally:
            with self._lock:
                self._closed = True
                self._error = error
                pending = list(self._pending.values())
                self._pending.clear()
            for future, _ in pending:
                future.set_exception(error)

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader at once
        self._reader.join(timeout)
        self._sock.close()
