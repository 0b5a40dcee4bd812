"""The one thread that talks to UCX: a ucxx worker progressed in blocking mode.

Why our own thread rather than ucxx's asyncio layer: per 375 KB message over TCP, the
asyncio path (caller -> event loop -> ucxx progress thread -> notifier thread -> event
loop -> caller) cost 450-900 us of CPU, the same transfer driven directly 150-300 us
(docs/multinode.md). On 2 cores carrying 8 emulated nodes that difference decides
whether a pipeline runs at the wire limit.

Every UCX call is made on this thread, so nothing depends on ucxx's thread safety: other
threads hand it closures (``call``, ``submit``) and wait on the returned Request. The
loop: run the queued closures, progress the worker until it is idle, complete the
finished requests, arm the worker and sleep in epoll on the worker's events and on an
eventfd that ``call`` writes. Nothing polls: idle, the thread sleeps.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from lpsync.transport.mesh import Request

log = logging.getLogger("lpsync.ucx")

T = TypeVar("T")
_IDLE_WAKE_S = 1.0  # a safety net only: every event that matters wakes the thread

# UCX objects of runtimes that live as long as their process (a daemon's), kept from
# destruction until it exits: destroying a listener while a peer dials crashes UCX's async
# thread (ucp_cm_server_conn_request_cb on the freed listener, openucx/ucx#11087; seen as
# SIGSEGV in 3 of 15 five-daemon stops under load). Such a process leaves by os._exit.
_KEPT_UNTIL_EXIT: list[Any] = []


def keep_until_exit(*objects: Any) -> None:
    """Never destroy ``objects`` (UCX listener, worker, context) in this process."""
    _KEPT_UNTIL_EXIT.extend(o for o in objects if o is not None)


def kept_until_exit() -> bool:
    """True when this process holds UCX objects that must not be destroyed: it must end
    with os._exit, not the interpreter's finalization."""
    return bool(_KEPT_UNTIL_EXIT)


class ProgressThread:
    """Owns one ucxx context and worker; ``config`` holds UCX options without the UCX_ prefix."""

    def __init__(self, config: dict[str, str], name: str, until_exit: bool = False) -> None:
        # Imported here: importing ucxx exports UCX variables into os.environ, which an
        # import of lpsync must not do. ucxx's C++ layer prints every endpoint error to
        # stdout ("Endpoint is not connected" for each dial a peer drops while its mesh is
        # not forming): we report failures ourselves, so it prints fatal ones only unless
        # UCXX_LOG_LEVEL says otherwise.
        os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self.api = ucx_api
        self.array = Array  # a ucxx buffer view over anything with the buffer protocol
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP, ucx_api.Feature.STREAM)
        self.context: Any = ucx_api.UCXContext(config, feature_flags=features)
        self.worker: Any = ucx_api.UCXWorker(
            self.context, enable_delayed_submission=False, enable_python_future=False
        )
        self.worker.init_blocking_progress_mode()
        # (run, fail): fail(error) instead of run when the thread is gone
        self._calls: collections.deque[tuple[Callable[[], None], Callable[[BaseException], None]]] = (
            collections.deque()
        )
        self._wake_lock = threading.Lock()  # the eventfd is never written after it is closed
        self._closed = False
        self._in_flight: list[Request] = []
        self._after_progress: list[Callable[[], None]] = []
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._stopping = False
        self._until_exit = until_exit  # keep the worker and context (keep_until_exit)
        self._adopted: weakref.WeakSet[Any] = weakref.WeakSet()  # endpoints: closed before the worker
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- from any thread -------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the progress thread; its result or exception in the Future."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)

        self._post(run, future.set_exception)
        return future

    def submit(
        self,
        start: Callable[[], Any],
        keep: Any = None,
        on_done: Callable[[Request], None] | None = None,
        request: Request | None = None,
    ) -> Request:
        """Start a UCX operation: ``start`` runs on the progress thread and returns the
        UCXRequest (e.g. ``lambda: ep.tag_send(...)``); ``keep`` (its buffer) stays
        referenced until it ends. ``on_done`` runs on the progress thread when it
        finishes; waiters use ``request.event()``. ``request``: the one to fill (made
        by the caller to track it before it is posted)."""
        request = request if request is not None else Request()
        request.on_done, request.keep = on_done, keep

        def run() -> None:
            try:
                request.ucx = start()
            except BaseException as error:
                request.finish(error)
                return
            self._in_flight.append(request)

        self._post(run, request.finish)
        return request

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; it drops the worker and context on its way out."""
        if self._thread.is_alive():
            self._stopping = True
            self._post(lambda: None, lambda _error: None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- on the progress thread ------------------------------------------------------------

    def after_progress(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the requests finished by the current progress call are complete
        (a UCX callback that must see them, e.g. an endpoint closing right after its last
        message arrived)."""
        self._after_progress.append(fn)

    def adopt(self, endpoint: Any) -> None:
        """On the progress thread: ``endpoint`` (with a ``close()`` for this thread) is
        closed at teardown, before the worker and context go, if it is still open."""
        self._adopted.add(endpoint)

    def _post(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        with self._wake_lock:
            if not self._closed:
                self._calls.append((run, fail))
                os.eventfd_write(self._wake, 1)
                return
        fail(RuntimeError("the UCX progress thread has stopped"))

    def _run(self) -> None:
        worker, calls = self.worker, self._calls
        try:
            while True:
                while calls:
                    calls.popleft()[0]()
                worker.progress()
                if self._in_flight:
                    self._complete()
                while self._after_progress:
                    self._after_progress.pop(0)()
                if self._stopping and not calls:
                    break
                if calls or not worker.arm():  # more work, or events arrived meanwhile
                    continue
                self._epoll.poll(_IDLE_WAKE_S)
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
        except BaseException:
            log.exception("the UCX progress thread failed")
            raise
        finally:
            self._teardown()

    def _complete(self) -> None:
        still = []
        for request in self._in_flight:
            if not request.ucx.completed:
                still.append(request)
                continue
            error: BaseException | None = None
            try:
                request.ucx.check_error()
            except Exception as failure:
                error = failure
            request.ucx = None  # drop the UCX request now, on this thread
            request.finish(error)
        self._in_flight = still

    def _teardown(self) -> None:
        with self._wake_lock:
            self._closed = True
        stopped = RuntimeError("the UCX progress thread stopped")
        while self._calls:
            self._calls.popleft()[1](stopped)
        for request in self._in_flight:
            request.ucx = None
            request.finish(stopped)
        self._in_flight.clear()
        for endpoint in list(self._adopted):
            try:
                endpoint.close()
            except Exception as error:  # the others still need closing
                log.warning("closing a UCX endpoint at teardown: %r", error)
        self._epoll.close()
        os.close(self._wake)
        if self._until_exit:
            keep_until_exit(self.worker, self.context)
        # UCX objects die on the thread that made them.
        self.worker = None
        self.context = None
