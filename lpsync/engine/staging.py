"""Pinned host memory for device collectives across nodes: HostMirrors (host copies of
device spans, pinned on CUDA so that cudaMemcpyAsync is asynchronous, freed once no run
uses them) and the daemon's RingPool of them (the bounded rings that multi-node device
collectives' segments cross through: hierarchy.py, packed.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpsync.engine.buffers import host_array
from lpsync.memory.kind import MemoryKind, Span

_BYTE = np.dtype(np.uint8)
_serials = itertools.count(1)
# Pinned host slots of a bounded ring (hierarchy.py, packed.py): a segment on the wire,
# the next ones filling, the last one draining.
RING_SLOTS = 4


@dataclass(eq=False)
class Mirror:
    """One device span and its host copy (``array``: the host memory's bytes)."""

    device: Span
    host: Any  # host Memory (kind.allocate_host)
    array: np.ndarray  # uint8, a view of ``host``

    @property
    def lo(self) -> int:
        return self.array.__array_interface__["data"][0]

    @property
    def hi(self) -> int:
        return self.lo + self.array.nbytes

    def typed(self) -> np.ndarray:
        return self.array.view(self.device.dtype)


class HostMirrors:
    """The mirrors of one set of device spans, kept across runs (the pipeline's plans are
    keyed by host addresses) and freed by ``close`` once no run uses them."""

    def __init__(self, kind: MemoryKind, spans: Sequence[Span | None]) -> None:
        self.kind = kind
        # Unique for the process's lifetime (addresses are not: freed host memory comes
        # back): plans bound to these mirrors are cached under it.
        self.serial = next(_serials)
        self.mirrors: list[Mirror | None] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        try:
            for span in spans:
                self.mirrors.append(None if span is None else self._mirror(span))
        except BaseException:
            self._free()
            raise

    def _mirror(self, span: Span) -> Mirror:
        host = self.kind.allocate_host(span.nbytes, span.device)  # in the span's device context
        # Both kinds hand out host memory of this process: view it without a copy.
        return Mirror(span, host, host_array(host, span.nbytes))

    def acquire(self) -> None:
        with self._lock:
            self._busy += 1

    def release(self) -> None:
        with self._lock:
            self._busy -= 1
            last = self._closed and self._busy == 0
        if last:
            self._free()

    def close(self) -> None:
        """Free now, or when the run (or its drain) still using them ends."""
        with self._lock:
            self._closed = True
            idle = self._busy == 0
        if idle:
            self._free()

    def _free(self) -> None:
        mirrors, self.mirrors = self.mirrors, []
        for mirror in mirrors:
            if mirror is not None:
                mirror.array = np.empty(0, np.uint8)
                self.kind.free(mirror.host)


@dataclass(frozen=True)
class _Place:
    """Where a ring's slots are allocated: a device's context (HostMirrors reads these two)."""

    device: int
    memory: Any = None


class RingPool:
    """The pinned host rings of the daemon's multi-node device collectives (hierarchy.py,
    packed.py: ``slots`` slots each), bounded in bytes for the whole daemon, not per job.

    A run leases its rings and gives them back once its streams drained; a ring given back
    stays allocated for the next run (no cudaHostAlloc per collective, whatever a job's
    mirrors do: rings are not in the jobs' plan caches) and goes preferably to the owner
    that had it last, so that the owner's plans, built over its slots' addresses, are
    reused. Allocated bytes stay within ``budget``: idle rings of another size are freed
    (least recently used first) to make room, else the lease waits for one to come back.
    Nodes lease independently, so two jobs could each hold a ring on one node and wait for
    one on the other: after ``patience`` seconds a lease takes its rings over the budget
    instead, freed when given back (``over_budget`` counts them), so contention slows a
    collective, never deadlocks it; so does a run that needs more than the whole budget.
    """

    def __init__(self, kind: MemoryKind, budget: int, slots: int, patience: float = 0.5) -> None:
        self.kind, self.budget, self.slots, self.patience = kind, budget, slots, patience
        self._cond = threading.Condition()
        self._idle: list[tuple[tuple, HostMirrors]] = []  # (last owner, ring), least recent first
        self._bytes: dict[int, int] = {}  # id(ring) -> bytes, for each ring within the budget
        self.allocated = 0  # rings allocated (tests: reuse keeps this flat)
        self.over_budget = 0  # rings taken over the budget
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of every ring within the budget, leased or idle."""
        with self._cond:
            return sum(self._bytes.values())

    def lease(
        self, owner: tuple, slot_bytes: int, count: int, device: int, deadline: float
    ) -> list[HostMirrors]:
        """``count`` rings of ``slots`` slots of ``slot_bytes``, all or none (a run never
        holds some while it waits for the others), new ones allocated in ``device``'s
        context. Give them back with ``give_back``."""
        size = self.slots * slot_bytes
        until = min(deadline, time.monotonic() + self.patience)
        freed: list[HostMirrors] = []
        with self._cond:
            while True:
                chosen = [i for i, (_, ring) in enumerate(self._idle) if self._bytes[id(ring)] == size]
                chosen.sort(key=lambda i: self._idle[i][0] != owner)  # its own first: its plans
                chosen = chosen[:count]
                missing = count - len(chosen)
                room = self.budget - sum(self._bytes.values())
                spare = [i for i in range(len(self._idle)) if i not in chosen]  # oldest first
                spare_bytes = sum(self._bytes[id(self._idle[i][1])] for i in spare)
                within = room + spare_bytes >= missing * size
                if within or missing * size > self.budget or time.monotonic() >= until:
                    for i in spare:
                        if room >= missing * size or not within:
                            break
                        room += self._bytes[id(self._idle[i][1])]
                        freed.append(self._idle[i][1])
                    gone = set(chosen) | {i for i in spare if self._idle[i][1] in freed}
                    taken = [self._idle[i][1] for i in chosen]
                    self._idle = [item for i, item in enumerate(self._idle) if i not in gone]
                    for ring in freed:
                        del self._bytes[id(ring)]
                    if not within:
                        self.over_budget += missing
                    break
                self._cond.wait(until - time.monotonic())
        for ring in freed:
            ring.close()  # on the kind's Releaser: cudaFreeHost synchronizes the device
        made: list[HostMirrors] = []
        try:
            for _ in range(missing):
                made.append(HostMirrors(self.kind, [Span(_Place(device), 0, slot_bytes, _BYTE)] * self.slots))
        except BaseException:
            for ring in made:
                ring.close()
            self.give_back(taken, owner)
            raise
        with self._cond:
            self.allocated += len(made)
            if within:
                for ring in made:
                    self._bytes[id(ring)] = size
        return taken + made

    def give_back(self, rings: list[HostMirrors], owner: tuple) -> None:
        """Rings whose run ended (its streams drained): kept for the next lease, or freed
        where they were taken over the budget."""
        with self._cond:
            kept = [r for r in rings if id(r) in self._bytes and not self._closed]
            dropped = [r for r in rings if id(r) not in self._bytes or self._closed]
            self._idle.extend((owner, ring) for ring in kept)
            for ring in dropped:
                self._bytes.pop(id(ring), None)
            self._cond.notify_all()
        for ring in dropped:
            ring.close()

    def close(self) -> None:
        """Daemon shutdown: the idle rings are freed, a leased one when given back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            for _, ring in idle:
                self._bytes.pop(id(ring), None)
        for _, ring in idle:
            ring.close()
