"""Each job's multi-node device collectives queue on streams of their own (second reading,
point 8): the direct path's "across" stream and the boundary's copy stream were one per
device for every job, so a slow job, or one whose peer died with a segment half-way,
held up every other job's segments behind its own. The plans here are the hierarchy's
own (hierarchy._plan over emulated device spans); only the peer plane is left out."""

from __future__ import annotations

import threading
import time
import types

import numpy as np

from lpsync.daemon.collectives import hierarchy, local
from lpsync.daemon.collectives.plans import GroupCache
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival, NodeLayout, Spec
from lpsync.engine.staging import RING_SLOTS
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync.types import Collective

COUNT = 4096


def _task(job: str, devices: DeviceRegistry, keep: list) -> types.SimpleNamespace:
    """A two-node allreduce as hierarchy.py reads it: this node serves rank 0, on device 0."""
    memory = devices.kind.allocate(0, COUNT * 4)
    keep.append(memory)
    spec = Spec("allreduce", "float32", COUNT, 0, "sum", "", "")
    arrival = Arrival(
        0, 1, spec, 30.0, Span(memory, 0, COUNT, np.dtype(np.float32)), None, (), lambda _: None
    )
    layout = NodeLayout((0, 1), 0)
    owner = types.SimpleNamespace(name=job, layout=layout, plans=GroupCache())
    return types.SimpleNamespace(
        job=owner,
        spec=spec,
        op=Collective.ALLREDUCE,
        dtype=np.dtype(np.float32),
        participants=2,
        arrivals=[arrival],
    )


def _plan(task: types.SimpleNamespace, devices: DeviceRegistry) -> hierarchy.Hierarchy:
    """The direct path's plan over a device ring of the daemon's own, leased as
    hierarchy.run leases it (and given back: these plans never run)."""
    link = types.SimpleNamespace(endpoint=object(), generation=0)
    owner = (task.job.name, "hierarchy")
    rings = devices.device_rings.lease(owner, COUNT, [0], time.monotonic() + 10)
    try:
        ring = hierarchy.Ring(None, {0: rings[0]})
        return hierarchy._plan(task, link, devices, ring, COUNT // 4, local.DEVICE_LINK)  # type: ignore[arg-type]
    finally:
        devices.device_rings.give_back(rings, owner)


def test_cuda_contract_one_jobs_queued_device_work_does_not_delay_anothers():
    kind = EmulatedKind(1)
    devices = DeviceRegistry(kind)
    devices.peer_direct = True  # the direct path: segments cross from device memory
    keep: list = []
    release = threading.Event()
    try:
        slow, quick = _task("slow", devices, keep), _task("quick", devices, keep)
        plans = [_plan(slow, devices), _plan(quick, devices)]
        lanes = [plan.direct[0] for plan in plans]  # each plan's cross stage on device 0
        assert lanes[0].stream is not lanes[1].stream
        lanes[0].stream.put(lambda: release.wait(30))  # the slow job's queued work
        span = slow.arrivals[0].data
        held = threading.Thread(target=lambda: lanes[0].copy(span[:16], span[16:32], time.monotonic() + 30))
        held.start()
        started = time.monotonic()
        target = quick.arrivals[0].data
        lanes[1].copy(target[:16], target[16:32], time.monotonic() + 2)  # was: timed out behind it
        assert time.monotonic() - started < 1.0
        assert held.is_alive(), "the slow job's own work did not wait"
        with_boundaries = [{id(s.stream) for s in plan.segments} for plan in plans]
        assert not with_boundaries[0] & with_boundaries[1]  # the boundary's copy streams too
        release.set()
        held.join(10)
        assert not held.is_alive()
        threads = sum(t.name.startswith("lpsync-emu-stream") for t in threading.enumerate())
        for plan in plans:
            plan.close()
        assert kind.releaser.flush(10)
        after = sum(t.name.startswith("lpsync-emu-stream") for t in threading.enumerate())
        assert after == threads - 4, "a plan's streams outlived it"  # across + boundary, twice
    finally:
        release.set()
        for memory in keep:
            kind.free(memory)
        devices.close()


def test_cuda_contract_a_jobs_lane_is_shared_by_its_plans_and_ends_with_the_last():
    kind = EmulatedKind(1)
    devices = DeviceRegistry(kind)
    try:
        first = devices.context.lane(("job",), 0, "across")
        second = devices.context.lane(("job",), 0, "across")
        other = devices.context.lane(("other",), 0, "across")
        assert first is second and first is not other
        devices.context.drop_lane(("job",), 0, "across")
        assert kind.releaser.flush(5) and not first.closed.is_set()
        devices.context.drop_lane(("job",), 0, "across")
        assert kind.releaser.flush(5) and first.closed.is_set()
        assert not other.closed.is_set()
    finally:
        devices.close()
        assert other.closed.is_set()  # shutdown ends the lanes still held


def test_cuda_contract_the_direct_paths_device_scratch_comes_from_the_bounded_pool():
    """Issue 47, item 4: the direct path's receive slots were allocated (cudaMalloc) for
    each plan and freed with it; now they come from the daemon's staging pool, whose
    unused memory is bounded in bytes, and a later plan reuses them, as it reuses the
    daemon's device ring (second reading, point 7)."""
    kind = EmulatedKind(1)
    devices = DeviceRegistry(kind)
    devices.peer_direct = True
    pool = devices.context.pool
    allocations: list[int] = []
    allocate = kind.allocate
    kind.allocate = lambda device, nbytes: allocations.append(nbytes) or allocate(device, nbytes)  # type: ignore[method-assign]
    keep: list = []
    try:
        plan = _plan(_task("job", devices, keep), devices)
        made = len(allocations)
        rings = RING_SLOTS  # the daemon's device ring, made once and kept by its own pool
        assert devices.device_rings.allocated == 1
        assert pool.outstanding > 0 and pool.allocated == made - rings - 1  # all but the task's buffer
        plan.close()
        assert pool.outstanding == 0 and 0 < pool.kept_bytes <= pool.keep_bytes
        again = _plan(_task("job", devices, keep), devices)  # the same sizes: reused
        assert len(allocations) == made + 1  # the new task's buffer only: ring and slots reused
        assert devices.device_rings.allocated == 1
        again.close()
    finally:
        for memory in keep:
            kind.free(memory)
        devices.close()


def test_cuda_contract_the_direct_path_crosses_from_the_daemons_own_device_memory():
    """Second reading, point 7: every span the direct path's cross stage hands the
    transport is in the daemon's device ring or its pool's slots, never in the client's
    IPC-mapped buffer (which the plan reaches by device copies on the boundary's stream)."""
    from lpsync_client import emulated as client
    from lpsync_client.wire import split_device_uuid

    kind = EmulatedKind(1)
    devices = DeviceRegistry(kind)
    devices.peer_direct = True
    allocation = client.Allocation(COUNT * 4, 0)
    keep: list = []
    try:
        task = _task("job", devices, keep)
        opened = kind.open(split_device_uuid(allocation.ipc_handle())[0], 0)
        task.arrivals[0].data = Span(opened, 0, COUNT, np.dtype(np.float32))  # the client's buffer
        plan = _plan(task, devices)
        assert plan.segments
        for segment in plan.segments:
            assert segment.across.memory.origin is None  # the daemon's own
            assert segment.source is not None and segment.source.memory is opened  # copied in...
            assert segment.result is not None and segment.result.memory is opened  # ...and out
            for participant in segment.cross.plans:
                for step in participant._steps:
                    assert step.dst.memory.origin is None
        plan.close()
        kind.close(opened)
    finally:
        for memory in keep:
            kind.free(memory)
        devices.close()
        allocation.free()
