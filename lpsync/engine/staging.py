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


class DeviceRing:
    """``slots`` buffers of ``slot_bytes`` on ``device``, the daemon's own (cudaMalloc'd once
    and kept by the pool): where the direct path's segments cross the nodes, so that UCX is
    only ever handed memory the daemon allocated (never a client's IPC mapping, which
    UCX's registration cache is not told of when it is closed)."""

    def __init__(self, kind: MemoryKind, device: int, slot_bytes: int, slots: int) -> None:
        self.kind, self.device, self.serial = kind, device, next(_serials)
        self.memory: list[Any] = []
        try:
            for _ in range(slots):
                self.memory.append(kind.allocate(device, max(slot_bytes, 1)))
        except BaseException:
            self.close()
            raise

    def span(self, slot: int, count: int, dtype: np.dtype) -> Span:
        return Span(self.memory[slot], 0, count, dtype)

    def close(self) -> None:
        memory, self.memory = self.memory, []
        for m in memory:
            self.kind.free(m)  # on the kind's Releaser


def host_ring(kind: MemoryKind, slot_bytes: int, slots: int, near: int) -> HostMirrors:
    """``slots`` pinned host slots of ``slot_bytes``, allocated in ``near``'s context."""
    return HostMirrors(kind, [Span(_Place(near), 0, slot_bytes, _BYTE)] * slots)


class RingPool:
    """The rings of the daemon's multi-node device collectives (``slots`` slots each):
    pinned host rings (hierarchy.py's staged path, packed.py) or device rings (the direct
    path), bounded in bytes for the whole daemon, not per job.

    A run leases its rings and gives them back once its streams drained; a ring given back
    stays allocated for the next run (no cudaHostAlloc or cudaMalloc per collective,
    whatever a job's mirrors do: rings are not in the jobs' plan caches) and goes
    preferably to the owner that had it last, so that the owner's plans, built over its
    slots' addresses, are reused. Allocated bytes stay within ``budget``: idle rings of
    another size (or device) are freed (least recently used first) to make room, else the
    lease waits for one to come back. Nodes lease independently, so two jobs could each
    hold a ring on one node and wait for one on the other: after ``patience`` seconds a
    lease takes its rings over the budget instead, freed when given back (``over_budget``
    counts them), so contention slows a collective, never deadlocks it; so does a run that
    needs more than the whole budget.
    """

    def __init__(
        self,
        kind: MemoryKind,
        budget: int,
        slots: int,
        patience: float = 0.5,
        on_device: bool = False,
    ) -> None:
        """``on_device``: device rings (DeviceRing, one device each), else pinned host
        rings (HostMirrors, usable from every device)."""
        self.kind, self.budget, self.slots, self.patience = kind, budget, slots, patience
        self.on_device = on_device
        self._cond = threading.Condition()
        self._idle: list[tuple[tuple, Any]] = []  # (last owner, ring), least recent first
        self._bytes: dict[int, int] = {}  # id(ring) -> bytes, for each ring within the budget
        self._place: dict[int, int] = {}  # id(ring) -> its device (device rings)
        self.allocated = 0  # rings allocated (tests: reuse keeps this flat)
        self.over_budget = 0  # rings taken over the budget
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of every ring within the budget, leased or idle."""
        with self._cond:
            return sum(self._bytes.values())

    def lease(self, owner: tuple, slot_bytes: int, places: Sequence[int], deadline: float) -> list[Any]:
        """One ring of ``slots`` slots of ``slot_bytes`` for each of ``places`` (its device:
        a device ring's, or the context a host ring is allocated in), in that order; all or
        none (a run never holds some while it waits for the others). Give them back with
        ``give_back``."""
        size = self.slots * slot_bytes
        until = min(deadline, time.monotonic() + self.patience)
        freed: list[Any] = []
        with self._cond:
            while True:
                chosen = self._choose(owner, size, places)
                missing = sum(1 for i in chosen if i is None)
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
                    taken = [None if i is None else self._idle[i][1] for i in chosen]
                    gone = {i for i in chosen if i is not None} | {
                        i for i in spare if self._idle[i][1] in freed
                    }
                    self._idle = [item for i, item in enumerate(self._idle) if i not in gone]
                    for ring in freed:
                        del self._bytes[id(ring)]
                        self._place.pop(id(ring), None)
                    if not within:
                        self.over_budget += missing
                    break
                self._cond.wait(until - time.monotonic())
        for ring in freed:
            ring.close()  # on the kind's Releaser: cudaFreeHost/cudaFree synchronize the device
        rings: list[Any] = []
        try:
            for ring, place in zip(taken, places, strict=True):
                rings.append(ring if ring is not None else self._make(slot_bytes, place, within))
        except BaseException:
            self.give_back([r for r in rings if r is not None] + [r for r in taken[len(rings) :] if r], owner)
            raise
        return rings

    def _choose(self, owner: tuple, size: int, places: Sequence[int]) -> list[int | None]:
        """For each place, an idle ring that fits (its index), the owner's own first (its
        plans are bound to them); None where none does."""
        chosen: list[int | None] = []
        for place in places:
            fits = [
                i
                for i, (_, ring) in enumerate(self._idle)
                if i not in chosen
                and self._bytes[id(ring)] == size
                and (not self.on_device or self._place[id(ring)] == place)
            ]
            fits.sort(key=lambda i: self._idle[i][0] != owner)
            chosen.append(fits[0] if fits else None)
        return chosen

    def _make(self, slot_bytes: int, place: int, within: bool) -> Any:
        if self.on_device:
            ring: Any = DeviceRing(self.kind, place, slot_bytes, self.slots)
        else:
            ring = host_ring(self.kind, slot_bytes, self.slots, place)
        with self._cond:
            self.allocated += 1
            if within:
                self._bytes[id(ring)] = self.slots * slot_bytes
                self._place[id(ring)] = place
        return ring

    def give_back(self, rings: Sequence[Any], owner: tuple) -> None:
        """Rings whose run ended (its streams drained): kept for the next lease, or freed
        where they were taken over the budget."""
        with self._cond:
            kept = [r for r in rings if id(r) in self._bytes and not self._closed]
            dropped = [r for r in rings if id(r) not in self._bytes or self._closed]
            self._idle.extend((owner, ring) for ring in kept)
            for ring in dropped:
                self._bytes.pop(id(ring), None)
                self._place.pop(id(ring), None)
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
                self._place.pop(id(ring), None)
        for _, ring in idle:
            ring.close()
