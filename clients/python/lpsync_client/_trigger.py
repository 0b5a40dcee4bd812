"""The trigger socket: the Session protocol over a Unix SOCK_SEQPACKET socket, no gRPC.

Same messages and the same Future-based API as the gRPC SessionStream; requests leave
from the calling thread (no hand-off). Replies are read by one thread at a time (the
``_reading`` lock): a thread blocked in a collective call reads them itself while no
other thread is reading (``settle``: no hand-off to a reader thread and back, which was
a third of a blocking call's CPU), and the background reader thread reads them for
everything else (async calls, their callbacks, other threads' calls). Whichever thread
reads a reply completes its Future, so an async call's done-callbacks may run on a
thread that is blocked in another collective of the same client.

Nothing waits forever: the background reader wakes for every async request and when a
foreground reader stops with requests still pending; every wait has a timeout (the
socket's 1 s timeout, checked against close()); the gRPC Session stream stays open beside
it (it is how the daemon learns this client is gone).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from lpsync_client._pending import Call, Hook, PendingRequests
from lpsync_client.errors import LpsyncError, UnavailableError, from_status
from lpsync_client.wire.proto import lpsync_pb2 as pb

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
        _wait_at_most(self._sock, 1.0)
        self._pending = PendingRequests("trigger socket")
        self._closing = False
        self._ended = False  # the socket failed or closed: every request was failed
        self._reading = threading.Lock()  # held by the one thread reading replies
        self._work = threading.Condition()  # the background reader waits here for requests
        self._reader = threading.Thread(target=self._read, name="lpsync-client-trigger", daemon=True)
        self._reader.start()

    def submit(self, request: pb.SessionRequest, hook: Hook, foreground: bool = False) -> Call:
        """Send ``request``; ``foreground``: the caller waits for it at once with ``settle``
        (the background reader is not woken for it)."""
        call = self._pending.submit(request, hook, self._send)
        if foreground:
            call.settle_with = self.settle
        else:
            self.wake()
        return call

    def wake(self) -> None:
        """Have the background reader read every pending reply."""
        with self._work:
            self._work.notify()

    def settle(self, call: Call, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``call``, reading replies on this thread
        while no other thread reads them; whether it is done."""
        if not self.read_alone():
            return call.settled(timeout)  # another thread reads: it completes this one too
        deadline = time.monotonic() + timeout
        try:
            while not call.done() and not self._ended and time.monotonic() < deadline:
                self._receive()
        finally:
            self.stop_reading()
        return call.done()

    # -- a blocking call answered on its own thread (Client._answer_now) ------------------
    def read_alone(self) -> bool:
        """Whether this thread is now the one that reads replies (False: another one is;
        never waits). A True must be followed by stop_reading()."""
        return self._reading.acquire(blocking=False)

    def stop_reading(self) -> None:
        self._reading.release()
        if len(self._pending) and not self._ended:
            self.wake()  # requests of other threads: someone must go on reading

    def pending(self) -> int:
        """How many requests in the table wait for their replies."""
        return len(self._pending)

    def peer_closed(self) -> bool:
        """Whether the daemon closed this socket: a peek that takes nothing (the reading
        lock held: nobody else reads meanwhile)."""
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return not data

    def send_unlisted(self, request: pb.SessionRequest) -> int:
        """Send ``request`` with no Future and no entry in the table of requests in flight
        (its sender, which reads replies, waits for it at once with reply_to); its id."""
        return self._pending.send_unlisted(request, self._send)

    def reply_to(self, request_id: int, timeout: float) -> pb.SessionResponse | None:
        """Read replies on this thread (after read_alone) until the one to ``request_id``,
        completing other requests on the way; None when it has not come within
        ``timeout`` seconds. Raises the error every request got if the socket ends first."""
        deadline = time.monotonic() + timeout
        while not self._ended:
            response = self._next()
            if response is not None:
                if response.request_id == request_id:
                    return response
                self._pending.complete(response)
            elif time.monotonic() >= deadline:
                return None
        raise self._pending.error or UnavailableError("the trigger socket closed")

    def _send(self, request: pb.SessionRequest) -> None:
        try:
            self._sock.sendall(request.SerializeToString())
        except OSError as error:
            raise UnavailableError(f"the trigger socket failed: {error}") from None

    def _read(self) -> None:
        """The background reader: reads while requests are pending and no other thread
        does, sleeps while none are."""
        while True:
            with self._work:
                while not (self._ended or self._closing or len(self._pending)):
                    self._work.wait()
            if self._ended:
                return
            if self._closing and not len(self._pending):
                self._end(UnavailableError("the trigger socket closed"))
                return
            with self._reading:
                while len(self._pending) and not self._ended:
                    self._receive()

    def _receive(self) -> None:
        """Read one reply and complete its request (the ``_reading`` lock held)."""
        response = self._next()
        if response is not None:
            self._pending.complete(response)

    def _next(self) -> pb.SessionResponse | None:
        """One reply (the ``_reading`` lock held), or None: none came within the socket's
        timeout, or the socket failed or ended, or the daemon gave its reason for closing
        it (then every request in the table is failed with it: _end)."""
        try:
            data = self._sock.recv(MAX_PACKET)
        except (TimeoutError, BlockingIOError):  # the socket's 1 s (_wait_at_most)
            if self._closing:
                self._end(UnavailableError("the trigger socket closed"))
            return None
        except OSError as failure:
            self._end(UnavailableError(f"the trigger socket failed: {failure}"))
            return None
        if not data:
            self._end(UnavailableError("the trigger socket closed"))
            return None
        response = pb.SessionResponse.FromString(data)
        if response.request_id == 0 and response.WhichOneof("body") == "result":
            # The daemon's reason for closing this connection (a malformed packet, a
            # client that did not read its replies): every waiter gets it.
            r = response.result
            self._end(from_status(r.code or "UNAVAILABLE", r.message, r.error))
            return None
        return response

    def _end(self, error: LpsyncError) -> None:
        self._ended = True
        self._pending.fail_all(error)
        self.wake()  # the background reader ends

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reading thread at once
        with self._work:
            self._work.notify_all()
        self._reader.join(timeout)
        self._pending.fail_all(UnavailableError("the trigger socket closed"))
        self._sock.close()


def _wait_at_most(sock: socket.socket, seconds: float) -> None:
    """A blocking socket whose sends and receives give up after ``seconds`` (EAGAIN),
    timed by the kernel: Python's own timeout (settimeout) polls before every send and
    receive, two more system calls per collective."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
