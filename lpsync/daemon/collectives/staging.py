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
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival
from lpsync.engine.group import LocalGroup
from lpsync.engine.staging import ChunkStager, HostMirrors
from lpsync.errors import InvalidArgumentError
from lpsync.types import Collective


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
            device = a.data.device
            stream = context.stream(device, slots[device], "stage")
            slots[device] += 1
            mine = [m for m in self.mirrors.mirrors[2 * index : 2 * index + 2] if m is not None]
            write_back = not (spec.op == Collective.REDUCE and a.rank != spec.root)
            plan.hooks = ChunkStager(self.devices.kind, stream, plan, mine, write_back, device)

    def run(self, group: LocalGroup, deadline: float, timeout: float, tag_base: int) -> None:
        stagers = [plan.hooks for plan in group.plans]
        assert all(isinstance(s, ChunkStager) for s in stagers)
        busy = self.devices.use(
            [span.memory for a in self.device_arrivals for span in (a.data, a.out) if span is not None]
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


def stage(task: Task, devices: DeviceRegistry) -> Staged | None:
    """The local participants over host mirrors (None: host buffers, nothing to stage);
    the job's plans keep the mirrors."""
    if not task.on_device:
        return None
    arrivals = task.arrivals
    # The handles last: GroupCache.forget drops the mirrors with the buffers' groups.
    key = (
        tuple(
            (
                a.data.lo,
                a.data.nbytes,
                a.out.lo if a.out is not None else 0,
                a.out.nbytes if a.out is not None else 0,
            )
            for a in arrivals
        ),
        tuple(h for a in arrivals for h in a.handles),
    )
    mirrors = task.job.plans.mirrors(
        key, lambda: HostMirrors(devices.kind, [s for a in arrivals for s in (a.data, a.out)])
    )
    return Staged(task, devices, mirrors)


@contextlib.contextmanager
def whole(task: Task, devices: DeviceRegistry | None, deadline: float) -> Iterator[list[Arrival]]:
    """A small collective's participants on host copies of their device spans (whole:
    small collectives only, agreement.py carries their data), written back on success.
    Yields ``arrivals`` unchanged for host buffers. Each client's ready event is waited
    for first (the copies are synchronous)."""
    arrivals = task.arrivals
    if not task.on_device:
        yield arrivals
        return
    if devices is None:
        raise InvalidArgumentError("this daemon serves no devices (--devices)")
    kind = devices.kind
    busy = devices.use([span.memory for a in arrivals for span in (a.data, a.out) if span is not None])
    try:
        for a in arrivals:
            if a.ready is not None:  # polled: never a shared stream waiting on a client
                kind.wait_ready(a.ready, deadline)
        hosts = [
            replace(a, data=kind.read(a.data), out=None if a.out is None else kind.read(a.out))
            for a in arrivals
        ]
        yield hosts
        spec = task.spec
        for device, host in zip(arrivals, hosts, strict=True):
            if spec.op == Collective.REDUCE and device.rank != spec.root:
                continue  # a non-root's buffers of reduce are never written
            if device.out is not None:
                kind.write(device.out, host.out)
            else:
                kind.write(device.data, host.data)
    finally:
        devices.done(busy)
