"""Interprocess ready events, one per outstanding collective.

The daemon waits for the record a request was sent with; an event recorded again before
that (the next collective) would make it see a later record, or, recorded on another
stream, one that does not cover this collective's work. So events are pooled per
(framework, device, stream) and one is recorded again only once its previous record has
completed on that stream; then a later record covers everything the earlier one did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

E = TypeVar("E")
MAX_EVENTS = 16  # per stream; the daemon opens at most 64 per session


class ReadyEvents(Generic[E]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[Hashable, list[tuple[E, bytes]]] = {}
        self._turn: dict[Hashable, int] = {}

    def take(
        self, key: Hashable, make: Callable[[], tuple[E, bytes]], idle: Callable[[E], bool]
    ) -> tuple[E, bytes]:
        """An event of ``key`` whose last record completed (or a new one): (event, handle).
        All busy and MAX_EVENTS made: the next in turn (same stream: still correct, it
        only waits longer)."""
        with self._lock:
            pool = self._pools.setdefault(key, [])
            for entry in pool:
                if idle(entry[0]):
                    return entry
            if len(pool) < MAX_EVENTS:
                entry = make()
                pool.append(entry)
                return entry
            turn = self._turn.get(key, 0)
            self._turn[key] = turn + 1
            return pool[turn % len(pool)]
