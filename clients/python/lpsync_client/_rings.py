"""Asynchronous calls of armed plans: rung in order, answered on one waiter thread.

A blocking call of an armed plan rings the job's doorbell and sleeps on its slot
(Client._answer_now). An asynchronous one (a framework's comm hook: DDP's buckets) cannot
sleep on its caller's thread, and its slot holds one ring at a time. So it is queued
here: the first is rung at once, by its caller; a thread of the client waits for each
answer in turn, completes its Future, and rings the next. What the engine does not run
(FALLBACK, or a failure) is sent the general way with the same sequence number, and the
next ring waits for that reply: calls leave in sequence order, as on the general path.
A request that is not rung waits until the queue is empty (``drain``): a general-path
sequence number behind a queued ring would send that ring back to the general path. A
ring queued behind a general request still in flight is rung once that one is answered.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

from lpsync_client import doorbell
from lpsync_client._pending import Call, Latch
from lpsync_client.errors import CollectiveTimeoutError, LpsyncError, UnavailableError


@dataclass
class Ring:
    page: doorbell.Page
    plan: int
    generation: int
    sequence: int
    result: object  # what the call's Future holds when done (the written array)
    fallback: Callable[[], Call]  # sends the request the general way (same sequence number)
    bound: float  # seconds to wait for the answer
    call: Call
    after: Latch | None = None  # a general request sent before it: rung once that is answered
    posted: bool = False


class Rings:
    """One client's queue of asynchronous rings and the thread that answers them."""

    def __init__(self, gone: Callable[[], bool]) -> None:
        self._gone = gone  # the daemon closed the session
        self._queue: collections.deque[Ring] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def busy(self) -> bool:
        return bool(self._queue)

    def submit(self, ring: Ring) -> Call:
        """Queue ``ring`` (rung now when nothing is ahead of it); its Future."""
        with self._lock:
            if not self._queue and (ring.after is None or ring.after.is_set()):
                ring.page.post(ring.sequence, ring.plan, ring.generation)
                ring.posted = True
            self._queue.append(ring)
            if self._thread is None:
                self._thread = threading.Thread(target=self._answer, name="lpsync-rings", daemon=True)
                self._thread.start()
            self._changed.notify_all()
        return ring.call

    def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every queued ring is answered."""
        with self._lock:
            self._changed.wait_for(lambda: not self._queue or self._closed, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _answer(self) -> None:
        while True:
            with self._lock:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed with nothing left
                ring = self._queue[0]
            if not ring.posted:
                if ring.after is not None:  # in order: after the general request's reply
                    ring.after.wait(ring.bound)
                ring.page.post(ring.sequence, ring.plan, ring.generation)
                ring.posted = True
            self._settle(ring)
            with self._lock:
                self._queue.popleft()
                self._changed.notify_all()

    def _settle(self, ring: Ring) -> None:
        """Wait for ``ring``'s answer and complete its Future (through the general path
        where the engine did not run it)."""
        try:
            code = ring.page.answer(ring.sequence, ring.bound, self._gone)
        except TimeoutError:
            error: LpsyncError = (
                UnavailableError("the daemon closed the session during a collective")
                if self._gone()
                else CollectiveTimeoutError(f"the daemon did not answer within {ring.bound:g} s")
            )
            ring.call.set_exception(error)
            return
        if code == doorbell.OK:
            ring.call.set_result(ring.result)
            return
        general = ring.fallback()
        general.settled(ring.bound)  # in order: the next ring only after this one's reply
        if not general.done():
            ring.call.set_exception(
                CollectiveTimeoutError(f"the daemon did not answer within {ring.bound:g} s")
            )
        elif general.exception() is not None:
            ring.call.set_exception(general.exception())
        else:
            ring.call.set_result(general.result())
