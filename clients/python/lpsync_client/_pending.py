"""The table of requests in flight on one session transport (gRPC stream or trigger
socket): a request id per request, its Future completed from the response with that id,
and every Future failed when the transport ends, so nothing waits forever."""

from __future__ import annotations

import _thread
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future

from lpsync_client.errors import LpsyncError, UnavailableError
from lpsync_client.wire.proto import lpsync_pb2 as pb

Hook = Callable[[pb.SessionResponse], object]

# Set while this thread completes Futures (their done-callbacks run here): code that would
# wait for another collective must not, from here (that collective completes here too).
_completing = threading.local()


def completing_here() -> bool:
    """Whether the current thread is completing a collective's Future right now."""
    return getattr(_completing, "depth", 0) > 0


class Latch:
    """A one-shot event on one C lock, held until ``set``: where ``threading.Event`` is a
    Condition, a lock and a dozen Python calls per set and per wait (works and Futures
    are made per collective). ``set`` opens it for every waiter. The daemon's peer plane
    has the same (lpsync.transport.mesh.Done); the client package does not import the
    daemon's."""

    __slots__ = ("_lock", "flag")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()  # released once, by set()
        self.flag = False  # the answer to is_set (the lock is held a moment by each waiter)

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        self.flag = True
        try:  # noqa: SIM105 (per call: suppress() costs three Python calls)
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set within ``timeout`` seconds (None: however long it takes)."""
        if self.flag:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self.flag
        try:  # noqa: SIM105
            self._lock.release()  # open for every later waiter
        except RuntimeError:  # opened meanwhile by a second set
            pass
        return True


class Call(Future):
    """A request's Future, with what a collective's caller needs on top, per call and
    without a done-callback: ``on_cancel`` runs when the caller cancels it (the client
    tells the daemon), and ``settled`` waits on one C lock held until the Future is done,
    where ``result()`` waits through the Future's Condition (a new lock and a dozen Python
    calls per wait). Still a Future: ``concurrent.futures.wait`` and callbacks work."""

    def __init__(self) -> None:
        super().__init__()
        self.on_cancel: Callable[[], None] | None = None
        # How a caller that waits for it at once reads its reply on its own thread (the
        # trigger socket's settle); None: another thread completes it.
        self.settle_with: Callable[[Call, float], bool] | None = None
        self._open = Latch()  # set once the Future is done

    def wait(self, timeout: float) -> bool:
        """Whether it is done within ``timeout`` seconds, its reply read on this thread
        where it can be (settle_with)."""
        settle = self.settle_with
        return self.settled(timeout) if settle is None else settle(self, timeout)

    def settled(self, timeout: float) -> bool:
        """Whether the Future is done within ``timeout`` seconds."""
        return self._open.wait(timeout) or self.done()

    @property
    def latch(self) -> Latch:
        """Set once the Future is done: to wait for it without holding its result."""
        return self._open

    def _opened(self) -> None:
        self._open.set()

    def set_result(self, result: object) -> None:
        super().set_result(result)
        self._opened()

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self._opened()

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._opened()
        hook, self.on_cancel = self.on_cancel, None  # once: a cancelled Future cancels again
        if hook is not None:
            hook()
        return True


class PendingRequests:
    def __init__(self, what: str) -> None:
        self._what = what  # names the transport in errors
        self._pending: dict[int, tuple[Call, Hook]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._error: LpsyncError | None = None

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> LpsyncError | None:
        """Why the transport ended (every request was failed with it); None while open."""
        return self._error

    def submit(
        self, request: pb.SessionRequest, hook: Hook, send: Callable[[pb.SessionRequest], None]
    ) -> Call:
        """Give ``request`` an id and ``send`` it; the Future gets ``hook(response)`` or
        the hook's exception. ``send`` runs under the lock, so requests leave in id order
        (the daemon numbers collectives in arrival order); its LpsyncError is raised here."""
        future = Call()
        with self._lock:
            if self._error is not None:
                raise self._error
            rid = next(self._ids)
            request.request_id = rid
            self._pending[rid] = (future, hook)
            try:
                send(request)
            except BaseException:
                del self._pending[rid]
                raise
        return future

    def send_unlisted(self, request: pb.SessionRequest, send: Callable[[pb.SessionRequest], None]) -> int:
        """Give ``request`` an id and ``send`` it, in order with ``submit``'s, without a
        Future or an entry: its caller reads the reply itself (TriggerStream.reply_to), and
        a reply that comes after the caller stopped waiting is dropped. The id."""
        with self._lock:
            if self._error is not None:
                raise self._error
            request.request_id = rid = next(self._ids)
            send(request)
        return rid

    def complete(self, response: pb.SessionResponse) -> None:
        """Complete the Future of ``response.request_id`` (responses to requests that are no
        longer pending are dropped)."""
        with self._lock:
            entry = self._pending.pop(response.request_id, None)
        if entry is None:
            return
        future, hook = entry
        if not future.set_running_or_notify_cancel():
            return  # the caller cancelled it: nobody wants the answer
        _completing.depth = getattr(_completing, "depth", 0) + 1
        try:
            try:
                result = hook(response)
            except BaseException as failure:  # the hook's error belongs to the caller
                future.set_exception(failure)
            else:
                future.set_result(result)
        finally:
            _completing.depth -= 1

    def fail_all(self, error: LpsyncError | None = None) -> None:
        """The transport ended: refuse new requests and fail every pending one."""
        error = error or UnavailableError(f"the {self._what} closed")
        with self._lock:
            if self._error is None:
                self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
        _completing.depth = getattr(_completing, "depth", 0) + 1
        try:
            for future, _ in pending:
                if future.set_running_or_notify_cancel():  # not cancelled by its caller
                    future.set_exception(error)
        finally:
            _completing.depth -= 1
