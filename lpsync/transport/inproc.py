"""In-process transport: participants are threads of one process, messages are views.

Zero copy: a send hands the receiver a read-only view of the sender's span; the
receiver copies or reduces straight out of it and then releases it, which completes
the send. Each endpoint's mailbox is guarded by its own condition variable; every
wait has a deadline and wakes on abort.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from lpsync.errors import AbortedError, CollectiveTimeoutError, LpsyncError


class _Message:
    __slots__ = ("dst", "fabric", "raw", "released", "src", "tag")

    def __init__(self, raw: np.ndarray, fabric: InprocFabric, src: int, dst: int, tag: int) -> None:
        self.raw = raw
        self.released = threading.Event()
        self.fabric, self.src, self.dst, self.tag = fabric, src, dst, tag

    def done(self) -> bool:
        return self.released.is_set()

    def wait(self, deadline: float) -> None:
        if not self.released.wait(max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeoutError(
                f"rank {self.src} timed out waiting for rank {self.dst} to take message {self.tag}"
            )
        self.fabric.check()


class InprocFabric:
    """The shared state of ``size`` in-process endpoints."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._conditions = [threading.Condition() for _ in range(size)]
        self._mailboxes: list[dict[tuple[int, int], _Message]] = [{} for _ in range(size)]
        self._live: set[_Message] = set()
        self._live_lock = threading.Lock()
        self._error: LpsyncError | None = None

    def endpoint(self, rank: int) -> InprocEndpoint:
        return InprocEndpoint(self, rank)

    def abort(self, error: LpsyncError) -> None:
        """Fail every wait on this fabric, now and later, with ``error``."""
        self._error = error
        for condition in self._conditions:
            with condition:
                condition.notify_all()
        with self._live_lock:
            for message in self._live:
                message.released.set()

    def check(self) -> None:
        if self._error is not None:
            raise AbortedError(f"collective aborted: {self._error}") from self._error

    def _post(self, src: int, dst: int, tag: int, data: np.ndarray) -> _Message:
        raw = data.view(np.uint8)
        raw.flags.writeable = False
        message = _Message(raw, self, src, dst, tag)
        with self._live_lock:
            self._live.add(message)
        condition = self._conditions[dst]
        with condition:
            self._mailboxes[dst][(src, tag)] = message
            condition.notify_all()
        return message

    def _take(self, dst: int, src: int, tag: int, deadline: float) -> _Message:
        condition, box = self._conditions[dst], self._mailboxes[dst]
        with condition:
            while (message := box.pop((src, tag), None)) is None:
                self.check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {dst} timed out waiting for message {tag} from rank {src}"
                    )
                condition.wait(remaining)
        return message

    def _release(self, message: _Message) -> None:
        message.released.set()
        with self._live_lock:
            self._live.discard(message)


class InprocEndpoint:
    def __init__(self, fabric: InprocFabric, rank: int) -> None:
        self.fabric, self.rank, self.size = fabric, rank, fabric.size

    def send(self, peer: int, tag: int, data: np.ndarray) -> _Message:
        self.fabric.check()
        return self.fabric._post(self.rank, peer, tag, data)

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        message = self.fabric._take(self.rank, peer, tag, deadline)
        try:
            np.copyto(out.view(np.uint8), message.raw)
        finally:
            self.fabric._release(message)

    @contextmanager
    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float) -> Iterator[np.ndarray]:
        message = self.fabric._take(self.rank, peer, tag, deadline)
        try:
            if message.raw.nbytes != nbytes:
                raise LpsyncError(
                    f"message {tag} from rank {peer} has {message.raw.nbytes} bytes, expected {nbytes}"
                )
            yield message.raw
        finally:
            self.fabric._release(message)
