"""The "staged" stage: multi-node collectives on device buffers, over host mirrors.

The cross-node pipeline (path.py) runs one LocalGroup over host arrays; for device
buffers this module gives it host mirrors of the local participants' spans (kept in the
job's plans, so the pipeline's plans, keyed by address, are reused) and a ChunkStager per participant that
fills and drains them chunk by chunk on the participant's staging stream while the
pipeline runs (lpsync.engine.staging). The spans' allocations are marked busy for the
run, so a client dying mid-collective has its IPC mappings closed only after the staging
streams drained (DeviceRegistry.use/done).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import numpy as np

from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival
from lpsync.engine.group import LocalGroup
from lpsync.engine.staging import RING_SLOTS, ChunkStager, HostMirrors, Mirror
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.types import Collective

_BYTE = np.dtype(np.uint8)
__all__ = ["RING_SLOTS", "Staged", "drain", "stage", "whole"]


class Staged:
    """This run's local participants over host mirrors of their device spans."""

    def __init__(self, task: Task, devices: DeviceRegistry, mirrors: HostMirrors) -> None:
        self.spec, self.devices, self.mirrors = task.spec, devices, mirrors
        arrivals = self.device_arrivals = task.arrivals
        self.arrivals = []  # the same arrivals with host arrays (what the pipeline runs over)
        for a, i in zip(arrivals, range(0, 2 * len(arrivals), 2), strict=True):
            data, out = mirrors.mirrors[i], mirrors.mirrors[i + 1]
            assert data is not None
            self.arrivals.append(replace(a, data=data.typed(), out=None if out is None else out.typed()))

    def attach(self, group: LocalGroup) -> None:
        """Give every plan of a newly built group its stager (kept with the group)."""
        spec = self.spec
        context = self.devices.context
        slots: dict[int, int] = defaultdict(int)
        for index, (plan, a) in enumerate(zip(group.plans, self.device_arrivals, strict=True)):
            device = cast(Span, a.data).device  # device spans: staged tasks are on_device
            stream = context.stream(device, slots[device], "stage")
            slots[device] += 1
            mine = [m for m in self.mirrors.mirrors[2 * index : 2 * index + 2] if m is not None]
            write_back = not (spec.op == Collective.REDUCE and a.rank != spec.root)
            plan.hooks = ChunkStager(self.devices.kind, stream, plan, mine, write_back, device)

    def run(self, group: LocalGroup, deadline: float, timeout: float, tag_base: int) -> None:
        stagers = [plan.hooks for plan in group.plans]
        assert all(isinstance(s, ChunkStager) for s in stagers)
        busy = self.devices.use(
            [
                cast(Span, span).memory
                for a in self.device_arrivals
                for span in (a.data, a.out)
                if span is not None
            ]
        )
        self.mirrors.acquire()
        started: list[ChunkStager] = []
        try:
            for stager, a in zip(stagers, self.device_arrivals, strict=True):
                stager.start(deadline, a.ready)  # type: ignore[union-attr]
                started.append(stager)  # type: ignore[arg-type]
            group.run(timeout, tag_base)
            for stager in started:
                stager.finish()
        except BaseException:
            # Copies may still be queued: the failure is answered only once they drained
            # (the client may free its memory then), and unmapped and freed after that.
            self._drain(started, busy)
            raise
        self.devices.done(busy)
        self.mirrors.release()

    def _drain(self, stagers: list[ChunkStager], busy: list) -> None:
        try:
            for stager in stagers:
                stager.drain()
        finally:
            self.devices.done(busy)
            self.mirrors.release()


def _mirrors(task: Task, devices: DeviceRegistry) -> HostMirrors:
    """The pinned host mirrors of this task's local spans, kept in the job's plans."""
    arrivals = task.arrivals
    # The handles last: GroupCache.forget drops the mirrors with the buffers' groups.
    key = (
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
    return task.job.plans.mirrors(
        key,
        lambda: HostMirrors(
            devices.kind, cast("list[Span | None]", [s for a in arrivals for s in (a.data, a.out)])
        ),
    )


def stage(task: Task, devices: DeviceRegistry) -> Staged | None:
    """The local participants over host mirrors (None: host buffers, nothing to stage);
    the job's plans keep the mirrors."""
    if not task.on_device:
        return None
    return Staged(task, devices, _mirrors(task, devices))


def _bytes(mirror: Mirror) -> tuple[Span, Span]:
    """(device span, host span) of a mirror, as bytes."""
    span = mirror.device
    return Span(span.memory, span.offset, span.nbytes, _BYTE), Span(mirror.host, 0, span.nbytes, _BYTE)


def _pinned(context: Any, span: Span) -> Mirror:
    """A pinned host buffer from the staging pool for ``span`` (allocated in its device's
    context when the pool has none of the size)."""
    host = context.pool.take(-1, span.nbytes, span.device)
    array = (
        np.ctypeslib.as_array((ctypes.c_ubyte * span.nbytes).from_address(host.address))
        if span.nbytes
        else np.empty(0, np.uint8)
    )
    return Mirror(span, host, array)


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
