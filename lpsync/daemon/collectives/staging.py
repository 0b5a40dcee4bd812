"""The "staged" stage: multi-node collectives on device buffers where some node passes host
buffers (the flat path), and small ones whose data rides the agreement (``whole``).

The cross-node pipeline (path.py) runs one LocalGroup over every rank; here each local
participant runs its part on its own device spans (BouncedBuffers, lpsync.engine.buffers:
every message crosses host memory through a few pinned slots, copies and reductions stay
on the device), so host memory is the slots, not the buffers (the first reading mirrored
them whole: this path alone was unbounded). A job's BouncedBuffers are kept in its plans
(the pipeline's plans, keyed by address, are built over them), each on a stream of the
job's own (DeviceContext.lane). The spans' allocations are marked busy for the run, so a
client dying mid-collective has its IPC mappings closed only after the streams drained
(DeviceRegistry.use/done).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import numpy as np

from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival
from lpsync.engine.buffers import BouncedBuffers, host_array
from lpsync.engine.device_group import Lanes
from lpsync.engine.group import LocalGroup
from lpsync.engine.staging import RING_SLOTS, Mirror
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.types import Collective

_BYTE = np.dtype(np.uint8)
__all__ = ["RING_SLOTS", "Bounced", "Staged", "drain", "stage", "whole"]
_serials = itertools.count(1)


class Bounced:
    """One job's local participants' BouncedBuffers over one set of spans, kept across
    runs in the job's plans (GroupCache.mirrors: released buffers' go with them) and
    closed, slots back to the pool and streams ended, once no run uses them."""

    def __init__(self, task: Task, devices: DeviceRegistry) -> None:
        # Unique for the process's lifetime: the pipeline's plans over these are cached
        # under it (planning.bind).
        self.serial = next(_serials)
        context, kind = devices.context, devices.kind
        self.streams = Lanes(context, (task.job.name,))
        self.memory: list[BouncedBuffers] = []
        slots: dict[int, int] = defaultdict(int)
        # The job's slots on this node within --device-staging-bytes, as its ring would be
        # (hierarchy.py), whatever its buffers' size.
        budget = devices.staging_bytes // len(task.arrivals)
        for a in task.arrivals:
            device = cast(Span, a.data).device  # device spans: staged tasks are on_device
            stream = self.streams.get(device, f"stage-{slots[device]}")  # the job's own
            slots[device] += 1
            event = kind.event(device)
            self.memory.append(BouncedBuffers(kind, device, stream, event, context.pool, budget))
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False

    def acquire(self) -> None:
        with self._lock:
            self._busy += 1

    def release(self) -> None:
        with self._lock:
            self._busy -= 1
            last = self._closed and self._busy == 0
        if last:
            self._close()

    def close(self) -> None:
        """Now, or when the run (or its drain) still using them ends."""
        with self._lock:
            self._closed = True
            idle = self._busy == 0
        if idle:
            self._close()

    def _close(self) -> None:
        for memory in self.memory:
            memory.close()
        self.streams.close()


class Staged:
    """This run's local participants on their device spans (what planning.bind builds the
    pipeline's plan over, with ``memory``: one BouncedBuffers each)."""

    def __init__(self, task: Task, devices: DeviceRegistry, bounced: Bounced) -> None:
        self.devices, self.bounced = devices, bounced
        self.arrivals = task.arrivals  # device spans: the plans run on them
        self.memory = bounced.memory
        self.serial = bounced.serial

    def run(self, group: LocalGroup, deadline: float, timeout: float, tag_base: int) -> None:
        kind = self.devices.kind
        busy = self.devices.use(
            [cast(Span, span).memory for a in self.arrivals for span in (a.data, a.out) if span is not None]
        )
        self.bounced.acquire()
        try:
            for a in self.arrivals:
                if a.ready is not None:  # polled: never a stream waiting on a client
                    kind.wait_ready(a.ready, deadline)
            group.run(timeout, tag_base)
        except BaseException:
            # A copy may still be queued: the failure is answered only once it drained
            # (the client may free its memory then), and unmapped after that.
            for memory in self.memory:
                memory.drain()
            raise
        finally:
            self.devices.done(busy)
            self.bounced.release()


def _bounced(task: Task, devices: DeviceRegistry) -> Bounced:
    """The local participants' BouncedBuffers for these spans, kept in the job's plans."""
    arrivals = task.arrivals
    # The handles last: GroupCache.forget drops them with the buffers' groups.
    key = (
        "bounced",
        tuple(
            (
                cast(Span, a.data).lo,
                cast(Span, a.data).nbytes,
                cast(Span, a.out).lo if a.out is not None else 0,
                a.out.nbytes if a.out is not None else 0,
            )
            for a in arrivals
        ),
        tuple(h for a in arrivals for h in a.handles),
    )
    return cast(Bounced, task.job.plans.mirrors(key, lambda: Bounced(task, devices)))


def stage(task: Task, devices: DeviceRegistry) -> Staged | None:
    """The local participants on their device spans (None: host buffers, nothing to
    stage); the job's plans keep their BouncedBuffers."""
    if not task.on_device:
        return None
    return Staged(task, devices, _bounced(task, devices))


def _bytes(mirror: Mirror) -> tuple[Span, Span]:
    """(device span, host span) of a mirror, as bytes."""
    span = mirror.device
    return Span(span.memory, span.offset, span.nbytes, _BYTE), Span(mirror.host, 0, span.nbytes, _BYTE)


def _pinned(context: Any, span: Span) -> Mirror:
    """A pinned host buffer from the staging pool for ``span`` (allocated in its device's
    context when the pool has none of the size)."""
    host = context.pool.take(-1, span.nbytes, span.device)
    return Mirror(span, host, host_array(host, span.nbytes))


def _settle(kind: Any, lanes: list[tuple[Any, Any]], deadline: float) -> None:
    """Until every lane's stream finished what was queued on it so far."""
    for stream, event in lanes:
        kind.record(event, stream)
    for _, event in lanes:
        kind.synchronize(event, deadline)


@contextlib.contextmanager
def whole(task: Task, devices: DeviceRegistry | None, deadline: float) -> Iterator[list[Arrival]]:
    """A small collective's participants on host copies of their device spans (whole:
    small collectives only, agreement.py carries their data), written back on success.
    Yields ``arrivals`` unchanged for host buffers.

    Each client's ready event is polled first; the spans are copied into pinned host
    buffers from the staging pool (reused across calls: no cudaHostAlloc per collective,
    whichever buffers come) on a stream per participant, and back after the collective,
    and the caller answers only once those copies completed (an event per stream, waited
    for with the collective's deadline). A pageable cudaMemcpy
    (``kind.write``) may return before its bytes landed (CUDA's "the DMA to final
    destination may not have completed"): answering after it would let the client read
    its old values."""
    arrivals = task.arrivals
    if not task.on_device:
        yield arrivals
        return
    if devices is None:
        raise InvalidArgumentError("this daemon serves no devices (--devices)")
    kind, context = devices.kind, devices.context
    busy = devices.use(
        [cast(Span, span).memory for a in arrivals for span in (a.data, a.out) if span is not None]
    )
    taken: list[Mirror] = []
    lanes: list[tuple[Any, Any]] = []  # (stream, event) per participant
    try:
        for a in arrivals:
            if a.ready is not None:  # polled: never a shared stream waiting on a client
                kind.wait_ready(a.ready, deadline)
        mine = []
        for a in arrivals:
            pair = [None if span is None else _pinned(context, cast(Span, span)) for span in (a.data, a.out)]
            taken.extend(m for m in pair if m is not None)
            mine.append(pair)
        slots: dict[int, int] = defaultdict(int)
        for a, pair in zip(arrivals, mine, strict=True):
            device = cast(Span, a.data).device
            # Streams of their own: a small collective never queues behind a staged one.
            stream = context.stream(device, slots[device], "small")
            lanes.append((stream, context.event(device, slots[device], "small")))
            slots[device] += 1
            for mirror in pair:
                if mirror is not None:
                    on_device, on_host = _bytes(mirror)
                    kind.copy_async(on_host, on_device, stream)
        _settle(kind, lanes, deadline)
        hosts = []
        for a, (data, out) in zip(arrivals, mine, strict=True):
            assert data is not None
            hosts.append(replace(a, data=data.typed(), out=None if out is None else out.typed()))
        yield hosts
        spec = task.spec
        for a, (data, out), (stream, _) in zip(arrivals, mine, lanes, strict=True):
            if spec.op == Collective.REDUCE and a.rank != spec.root:
                continue  # a non-root's buffers of reduce are never written
            assert data is not None
            on_device, on_host = _bytes(out if out is not None else data)
            kind.copy_async(on_device, on_host, stream)
        _settle(kind, lanes, deadline)  # landed on the devices: only now may it be answered
    except BaseException:
        drain(kind, lanes)  # nothing of it may still touch the spans once answered
        raise
    finally:
        devices.done(busy)
        for mirror in taken:  # drained (or never used): back to the pool
            context.pool.give(mirror.host)


def drain(kind: Any, lanes: list[tuple[Any, Any]], patience: float = 3600.0) -> None:
    """Until every (stream, event) lane ran what is queued on it (errors ignored: the
    failure is what is reported), then clear the streams' errors where the kind can."""
    with contextlib.suppress(Exception):  # the failure itself is what is reported
        _settle(kind, lanes, time.monotonic() + patience)
    recover = getattr(kind, "recover", None)  # the emulated stream's error cleared
    if recover is not None:
        for stream, _ in lanes:
            recover(stream)
