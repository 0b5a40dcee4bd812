"""Device spans across nodes: host mirrors filled and drained chunk by chunk.

The cross-node pipeline (LocalGroup over a RoutedEndpoint, lpsync.engine.executor) runs
over host arrays. For device buffers each span gets a host mirror (pinned on CUDA, so
that cudaMemcpyAsync is asynchronous) and a ChunkStager per participant moves bytes
between span and mirror on a dedicated stream, one chunk at a time, in the order the
participant's program first needs them:

  * ``start`` enqueues one device-to-host copy per chunk of the input that the program
    reads before it writes it (first use first), each followed by an event record; the
    stream runs them while the pipeline sends, so the copy of chunk c+1 overlaps the send
    of chunk c;
  * ``ready(i)`` (the Plan calls it before step i touches its spans, and before it posts
    a receive ahead) blocks only until the copies of the chunks that step touches landed:
    a step never waits for the whole buffer;
  * ``done(i)`` (after step i) enqueues the host-to-device copy of every range of the
    result that step i wrote last, so a received or reduced chunk goes back to the device
    while the next one is received;
  * ``finish`` waits for the stream; ``drain`` after a failure.
The ranges come from the schedule once (``Plan.accesses``), so a run costs one list
lookup per step plus the copies. Invariant: every device-to-host copy is enqueued before
any host-to-device copy on the same stream, and a step touching a range always waits for
the copy that fills it, so a late copy never overwrites what the pipeline wrote.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpsync.engine.executor import Plan
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
        array = (
            np.ctypeslib.as_array((ctypes.c_ubyte * span.nbytes).from_address(host.address))
            if span.nbytes
            else np.empty(0, np.uint8)
        )
        return Mirror(span, host, array)

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


def _subtract(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi) outside the sorted disjoint intervals ``covered``."""
    pieces = []
    i = max(0, bisect.bisect_right(covered, (lo, lo)) - 1)
    while lo < hi and i < len(covered):
        a, b = covered[i]
        if a >= hi:
            break
        if b > lo:
            if a > lo:
                pieces.append((lo, a))
            lo = max(lo, b)
        i += 1
    if lo < hi:
        pieces.append((lo, hi))
    return pieces


def _add(lo: int, hi: int, covered: list[tuple[int, int]]) -> None:
    """Merge [lo, hi) into the sorted disjoint intervals ``covered``."""
    i = bisect.bisect_left(covered, (lo, lo))
    if i and covered[i - 1][1] >= lo:
        i -= 1
    j = i
    while j < len(covered) and covered[j][0] <= hi:
        lo, hi = min(lo, covered[j][0]), max(hi, covered[j][1])
        j += 1
    covered[i:j] = [(lo, hi)]


class ChunkStager:
    """One participant's chunk-wise staging between its device spans and their mirrors
    (the Plan's ``hooks``). ``write_back=False``: the result is not copied to the device
    (a non-root's buffers of reduce)."""

    def __init__(
        self,
        kind: MemoryKind,
        stream: Any,
        plan: Plan,
        mirrors: Sequence[Mirror],
        write_back: bool = True,
        device: int | None = None,
    ) -> None:
        """``device``: the stream's (default: the first mirror's span's); the events are made
        on it, since an event can only be recorded on its own device's streams."""
        self.kind, self.stream = kind, stream
        on = device if device is not None else (mirrors[0].device.device if mirrors else 0)
        self._mirrors = sorted(mirrors, key=lambda m: m.lo)
        accesses = plan.accesses()
        self.loads: list[tuple[Span, Span]] = []  # (host, device) per chunk, first use first
        load_at: list[tuple[int, int, int]] = []  # (lo, hi, load index), sorted by lo
        touched: list[tuple[int, int]] = []
        self.need: list[int] = []  # per step: the last load it must wait for (-1: none)
        for reads, write in accesses:
            for lo, hi in reads:
                for a, b in _subtract(lo, hi, touched):
                    for host, dev, x, y in self._pieces(a, b):
                        bisect.insort(load_at, (x, y, len(self.loads)))
                        self.loads.append((host, dev))
            ranges = list(reads) + ([write] if write is not None else [])
            self.need.append(
                max((k for lo, hi in ranges for k in self._overlapping(load_at, lo, hi)), default=-1)
            )
            for lo, hi in ranges:
                _add(lo, hi, touched)
        self.stores: list[tuple[tuple[Span, Span], ...]] = [()] * len(accesses)
        if write_back:
            covered: list[tuple[int, int]] = []
            for index in range(len(accesses) - 1, -1, -1):
                write = accesses[index][1]
                if write is None:
                    continue
                self.stores[index] = tuple(
                    (device, host)
                    for a, b in _subtract(*write, covered)
                    for host, device, _, _ in self._pieces(a, b)
                )
                _add(*write, covered)
        self.events = [kind.event(on) for _ in self.loads]
        self.final = kind.event(on)
        self._waited = -1
        self._deadline = 0.0

    def _pieces(self, lo: int, hi: int) -> list[tuple[Span, Span, int, int]]:
        """[lo, hi) split over the mirrors: (host span, device span, lo, hi) of bytes."""
        out = []
        for m in self._mirrors:
            a, b = max(lo, m.lo), min(hi, m.hi)
            if a < b:
                offset = a - m.lo
                out.append(
                    (
                        Span(m.host, offset, b - a, _BYTE),
                        Span(m.device.memory, m.device.offset + offset, b - a, _BYTE),
                        a,
                        b,
                    )
                )
        return out

    @staticmethod
    def _overlapping(load_at: list[tuple[int, int, int]], lo: int, hi: int) -> list[int]:
        i = max(0, bisect.bisect_right(load_at, (lo, lo, -1)) - 1)
        found = []
        while i < len(load_at) and load_at[i][0] < hi:
            _, b, k = load_at[i]
            if b > lo:
                found.append(k)
            i += 1
        return found

    # -- one run -----------------------------------------------------------------------------
    def start(self, deadline: float, ready: Any = None) -> None:
        """Enqueue every chunk's device-to-host copy (first use first), after ``ready``
        (the client's interprocess event, polled from the host: the staging streams are
        shared by every job) when given."""
        self._deadline, self._waited = deadline, -1
        kind, stream = self.kind, self.stream
        if ready is not None:
            kind.wait_ready(ready, deadline)
        for (host, device), event in zip(self.loads, self.events, strict=True):
            kind.copy_async(host, device, stream)
            kind.record(event, stream)

    def ready(self, index: int) -> None:
        k = self.need[index]
        if k > self._waited:  # loads land in order: waiting for k covers every earlier one
            self.kind.synchronize(self.events[k], self._deadline)
            self._waited = k

    def done(self, index: int) -> None:
        for device, host in self.stores[index]:
            self.kind.copy_async(device, host, self.stream)

    def finish(self) -> None:
        """Wait until every write-back reached the device."""
        self.kind.record(self.final, self.stream)
        self.kind.synchronize(self.final, self._deadline)

    def drain(self, patience: float = 3600.0) -> None:
        """After a failed run: wait for what it left queued, then clear the stream's error
        where the kind can (emulated)."""
        self.kind.record(self.final, self.stream)
        with contextlib.suppress(Exception):  # the run already reported its failure
            self.kind.synchronize(self.final, time.monotonic() + patience)
        recover = getattr(self.kind, "recover", None)
        if recover is not None:
            recover(self.stream)
