"""One thread that fires callbacks at deadlines (collective timeouts, stream grace).

A heap of (deadline, n, callback) under a condition variable; the thread sleeps until
the earliest deadline or a new earlier one. Cancelled entries are dropped lazily and
the heap is compacted when they outnumber the live ones, so millions of short
collectives do not grow it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("lpsync.daemon")
_MAX_SLEEP = 3600.0


class Timer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.callback = None


class Watcher:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="lpsync-watcher", daemon=True)
        self._thread.start()

    def at(self, deadline: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback`` (in the watcher thread) at ``deadline`` (time.monotonic)."""
        timer = Timer(callback)
        with self._cond:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (deadline, next(self._counter), timer))
            if earliest is None or deadline < earliest:
                self._cond.notify()
            if len(self._heap) > 1024 and len(self._heap) % 1024 == 0:
                self._heap = [e for e in self._heap if not e[2].cancelled]
                heapq.heapify(self._heap)
        return timer

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    # Capped so a far deadline never overflows the lock's timeout.
                    timeout = min(self._heap[0][0] - time.monotonic(), _MAX_SLEEP) if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                _, _, timer = heapq.heappop(self._heap)
            callback = timer.callback
            if callback is not None and not timer.cancelled:
                try:
                    callback()
                except Exception:
                    log.exception("deadline callback failed")

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)
