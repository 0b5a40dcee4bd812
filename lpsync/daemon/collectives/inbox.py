"""Receive from any source: which rank's message comes next to a receiver.

A message is a send of a pair job (the client's _p2p.py: a two-rank job per source,
destination and tag; its sequence numbers order the messages of one source). The daemon
of the sender announces each send to the daemon of the receiver (directly when both are
here, over the peer plane's notes otherwise); a receiver's Probe names, per source, how
many receives it has issued already (those messages are spoken for), and gets the oldest
announced message beyond them, or waits for one until its deadline. A message leaves the
inbox when its pair collective finished here (either way), or at its send's deadline.

Everything is keyed by (job, destination rank, tag) of the main job; the messages and
the waiting probes are bounded in all, whatever the keys.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lpsync.daemon.watcher import Timer, Watcher
from lpsync.errors import CollectiveTimeoutError, LpsyncError, ResourceExhaustedError

log = logging.getLogger("lpsync.daemon")

Key = tuple[str, int, int]  # (job, destination rank, tag)
Found = Callable[[int, int], None]  # (source rank, sequence)
Failed = Callable[[LpsyncError], None]
_FINISHED_KEPT = 65536  # (key, source) pairs whose last finished message is remembered


@dataclass
class _Message:
    source: int
    sequence: int
    expires: float  # time.monotonic(): the send's own deadline


@dataclass
class _Waiter:
    issued: Mapping[int, int]
    found: Found
    failed: Failed
    timer: Timer | None = None
    since: float = field(default_factory=time.monotonic)


class Inbox:
    def __init__(self, watcher: Watcher, max_messages: int = 4096) -> None:
        self._watcher = watcher
        self._max = max_messages
        self._lock = threading.Lock()
        # Bounded in all (``max_messages`` each), not per key: a key is a (job, rank, tag).
        self._messages: dict[Key, list[_Message]] = {}
        self._held = 0
        self._waiters: dict[Key, list[_Waiter]] = {}
        self._waiting = 0
        # By (key, source): the highest sequence that finished here; a late announcement of
        # it (it crossed the peer plane slower than the data) is dropped.
        self._finished: dict[tuple[Key, int], int] = {}

    def announce(self, key: Key, source: int, sequence: int, timeout: float) -> None:
        """A send from ``source`` to ``key``'s rank (its pair job's ``sequence``)."""
        now = time.monotonic()
        with self._lock:
            if sequence <= self._finished.get((key, source), 0):
                return
            if self._held >= self._max:
                self._keep(lambda m: m.expires > now)
            messages = self._messages.setdefault(key, [])
            if self._held >= self._max:
                log.warning("inbox full (%d sends announced, none received); the oldest dropped", self._max)
                if not messages:  # another key's fill it: this one is refused
                    del self._messages[key]
                    return
                del messages[0]
                self._held -= 1
            messages.append(_Message(source, sequence, now + timeout))
            self._held += 1
            waiter = self._take_waiter(key)
        if waiter is not None:
            self._answer(key, waiter)

    def finished(self, key: Key, source: int, sequence: int) -> None:
        """``source``'s message ``sequence`` was received here (or failed): not waiting."""
        with self._lock:
            if sequence > self._finished.get((key, source), 0):
                self._finished.pop((key, source), None)  # newest last: the oldest go first
                self._finished[key, source] = sequence
                while len(self._finished) > _FINISHED_KEPT:
                    del self._finished[next(iter(self._finished))]
            if key in self._messages:
                self._keep(lambda m: not (m.source == source and m.sequence <= sequence), key)

    def _keep(self, keep: Callable[[_Message], bool], only: Key | None = None) -> None:
        """Drop the messages (of ``only``, or all) that ``keep`` refuses (lock held)."""
        for key in [only] if only is not None else list(self._messages):
            messages = self._messages[key]
            kept = [m for m in messages if keep(m)]
            self._held -= len(messages) - len(kept)
            if kept:
                self._messages[key] = kept
            else:
                del self._messages[key]

    def probe(
        self, key: Key, issued: Mapping[int, int], deadline: float, found: Found, failed: Failed
    ) -> None:
        """Call ``found(source, sequence)`` with the oldest message to ``key`` beyond
        ``issued`` (by source: receives already issued), now or when one is announced;
        ``failed`` with DEADLINE_EXCEEDED at ``deadline``. Never blocks."""
        waiter = _Waiter(issued, found, failed)
        with self._lock:
            if self._waiting >= self._max:
                error: LpsyncError | None = ResourceExhaustedError(
                    f"{self._waiting} receives from any source wait on this daemon already (at most "
                    f"{self._max}); job {key[0]!r} rank {key[1]} tag {key[2]} refused"
                )
            else:
                error = None
                self._waiters.setdefault(key, []).append(waiter)
                self._waiting += 1
                waiter.timer = self._watcher.at(deadline, lambda: self._expire(key, waiter))
        if error is not None:
            failed(error)
            return
        self._answer(key, None)

    def waiting(self, job: str) -> list[tuple[int, int, float]]:
        """(rank, tag, seconds waited) of ``job``'s probes that wait, for Status."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                (rank, tag, now - w.since)
                for (name, rank, tag), waiters in self._waiters.items()
                if name == job
                for w in waiters
            )

    def _answer(self, key: Key, taken: _Waiter | None) -> None:
        """Answer the key's first waiter (``taken``: already off the list) if a message
        is there for it; the client probes again only after issuing that receive."""
        with self._lock:
            waiter = taken or self._take_waiter(key)
            if waiter is None:
                return
            match = self._match(key, waiter.issued)
            if match is None:  # back to the front: it still waits
                self._waiters.setdefault(key, []).insert(0, waiter)
                self._waiting += 1
                return
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.found(match.source, match.sequence)

    def _take_waiter(self, key: Key) -> _Waiter | None:
        waiters = self._waiters.get(key)
        if not waiters:
            return None
        waiter = waiters.pop(0)
        self._waiting -= 1
        if not waiters:
            del self._waiters[key]
        return waiter

    def _match(self, key: Key, issued: Mapping[int, int]) -> _Message | None:
        now = time.monotonic()
        for message in self._messages.get(key, ()):
            if message.expires > now and message.sequence > issued.get(message.source, 0):
                return message
        return None

    def _expire(self, key: Key, waiter: _Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(key, [])
            if waiter not in waiters:
                return  # answered meanwhile
            waiters.remove(waiter)
            self._waiting -= 1
            if not waiters:
                del self._waiters[key]
        job, rank, tag = key
        waiter.failed(
            CollectiveTimeoutError(
                f"no message for rank {rank} of job {job!r} with tag {tag} from any source "
                f"arrived within the receive's timeout"
            )
        )


def note(key: Key, source: int, sequence: int, timeout: float) -> bytes:
    """An announcement as it crosses the peer plane."""
    job, rank, tag = key
    return json.dumps([job, rank, tag, source, sequence, timeout]).encode()


def read_note(data: bytes) -> tuple[Key, int, int, float]:
    """(key, source, sequence, timeout) of a note; ValueError when it is not one."""
    try:
        job, rank, tag, source, sequence, timeout = json.loads(data)
        return (str(job), int(rank), int(tag)), int(source), int(sequence), float(timeout)
    except (TypeError, KeyError) as error:
        raise ValueError(f"not an announcement: {error}") from None
