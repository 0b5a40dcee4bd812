"""Issue order on overlapping buffers (DESIGN: collectives of one job whose buffers overlap
execute in sequence order; torch's contract for async work on one process group).

The daemon runs a job's collectives in sequence order on the buffers it was given. A
buffer outside shared memory is staged instead: copied in when its collective is issued
and out when it completes. A collective that reads or writes memory an earlier staged one
still writes would copy stale data in, or have its results overwritten; so it waits, when
issued, until every overlapping earlier one has finished (it could not start before then
anyway). Collectives on disjoint memory overlap freely. One exception: on the thread that
completes collectives (a Future's callback issuing another one), waiting could never end,
so there it is issued at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from lpsync_client._pending import Latch, completing_here

Span = tuple[str, int, int]  # (device, first byte, one past the last byte)


def span(device: str, first: int, shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> Span:
    """The bytes an array of ``shape`` and strides starting at address ``first`` can touch."""
    low = sum((n - 1) * s for n, s in zip(shape, byte_strides, strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, byte_strides, strict=True) if s > 0)
    return (device, first + low, first + high + itemsize)


def array_spans(arrays: Iterable[np.ndarray]) -> list[Span]:
    return [
        span("cpu", a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize)
        for a in arrays
        if a.size
    ]


def _overlap(a: list[Span], b: list[Span]) -> bool:
    return any(da == db and lo < hi2 and lo2 < hi for da, lo, hi in a for db, lo2, hi2 in b)


class InFlight:
    """Collectives that may still touch their staged buffers, with what they touch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[tuple[Latch, list[Span]]] = []

    def wait_before(self, touched: list[Span], bound: float) -> None:
        """Block until no earlier collective touching ``touched`` is in flight (at most
        ``bound`` seconds: past that the earlier one fails by itself)."""
        if not touched or completing_here():
            return
        with self._lock:
            self._works = [(done, s) for done, s in self._works if not done.is_set()]
            earlier = [done for done, s in self._works if _overlap(s, touched)]
        for done in earlier:
            done.wait(bound)

    def idle(self) -> bool:
        """Whether nothing tracked is in flight any more (wait_before would not wait)."""
        with self._lock:
            self._works = [(done, s) for done, s in self._works if not done.is_set()]
            return not self._works

    def add(self, done: Latch, touched: list[Span]) -> None:
        """Track a collective until ``done`` is set (once its results were copied out)."""
        if touched and not done.is_set():
            with self._lock:
                self._works.append((done, touched))
