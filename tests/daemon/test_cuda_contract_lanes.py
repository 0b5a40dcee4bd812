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
    link = types.SimpleNamespace(endpoint=object(), generation=0)
    return hierarchy._plan(task, link, devices, None, COUNT // 4, local.DEVICE_LINK)  # type: ignore[arg-type]


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
    unused memory is bounded in bytes, and a later plan reuses them."""
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
        assert pool.outstanding > 0 and pool.allocated == made - 1  # all but the task's buffer
        plan.close()
        assert pool.outstanding == 0 and 0 < pool.kept_bytes <= pool.keep_bytes
        again = _plan(_task("job", devices, keep), devices)  # the same sizes: reused
        assert len(allocations) == made + 1  # the new task's buffer only
        again.close()
    finally:
        for memory in keep:
            kind.free(memory)
        devices.close()
