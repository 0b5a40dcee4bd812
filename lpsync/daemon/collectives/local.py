"""The "run" stage of a single-node collective: direct, a host pipeline, or the device chain.

Chosen per collective and identical on every participant:
  * direct (direct.py): host buffers up to DIRECT_MAX_BYTES, one participant, or
    ``algorithm="direct"``;
  * a host pipeline: the tuner picks an algorithm and chunk count for local memory (or
    ``algorithm=`` forces one) and the engine's LocalGroup runs the schedule with one
    thread per participant over the zero-copy inproc transport;
  * device spans: the chain over the node's devices ordered by topology, run on streams
    (DeviceGroup), after each client's ready event.
Pipelines are built once per (spec, algorithm, buffers) and reused (plans.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.chain_order import chain_order
from lpsync.algorithms.registry import DIRECT
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.collectives import direct
from lpsync.daemon.collectives.direct import DIRECT_MAX_BYTES
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, nccl_bytes, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Outcome, Spec
from lpsync.engine.device_group import DeviceGroup
from lpsync.engine.group import LocalGroup
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Topology
from lpsync.types import BLOCKED, Collective, dtype_of

if TYPE_CHECKING:
    import numpy as np

    from lpsync.memory.kind import Span

# Local memory as the tuner sees it: a thread hand-off per message, memcpy bandwidth,
# and a link of its own between every pair of participants (no shared NIC).
LOCAL_LINK = LinkModel.from_bandwidth(alpha=30e-6, bandwidth=8e9, shared_nic=False)
# Device memory as the tuner sees it: a step's host-side cost (its copies and kernels
# enqueued from Python, its events recorded) and an NVLink-class copy; every pair of
# devices has links of its own. alpha is fitted to the H200 run (docs/benchmarks.md,
# "GPU"): 100-130 us per pipeline stage, where the 10 us of a bare launch had the tuner
# slice a 32 MiB allreduce into 96 ring steps (10.8 ms, against ~2 ms for be's 4).
DEVICE_LINK = LinkModel.from_bandwidth(alpha=100e-6, bandwidth=100e9, shared_nic=False)


def is_direct(spec: Spec, participants: int) -> bool:
    """Whether ``run`` takes the direct path for this spec (decided the same way there)."""
    if spec.op == Collective.BARRIER or spec.algorithm == DIRECT:
        return True
    if spec.algorithm:
        return False
    itemsize = dtype_of(spec.dtype).itemsize
    return participants == 1 or nccl_bytes(spec.op, spec.count, itemsize, participants) <= DIRECT_MAX_BYTES


def is_inline(spec: Spec, participants: int) -> bool:
    """Whether the event loop may run this collective itself: the direct path and small
    (``algorithm="direct"`` on a big buffer is direct but long: it goes to a worker)."""
    if spec.op == Collective.BARRIER:
        return True
    if not is_direct(spec, participants):
        return False
    return nccl_bytes(spec.op, spec.count, dtype_of(spec.dtype).itemsize, participants) <= DIRECT_MAX_BYTES


def run(task: Task, devices: DeviceRegistry | None) -> Outcome:
    """Run a single-node collective (every participant arrived, specs agree)."""
    if task.op is Collective.BARRIER:
        return Outcome(algorithm=DIRECT, chunks=1, seconds=task.elapsed())
    if task.on_device:
        if devices is None:
            raise InvalidArgumentError("this daemon serves no devices (--devices)")
        return _on_devices(task, devices)
    return _on_host(task)


def _on_host(task: Task) -> Outcome:
    spec, op, p = task.spec, task.op, task.participants
    views = cast("list[tuple[np.ndarray, np.ndarray]]", [buffers(spec, a, p) for a in task.arrivals])  # host
    reducing = reduction(spec, task.dtype, p)
    algorithm = spec.algorithm
    if algorithm == DIRECT or (not algorithm and (task.nbytes <= DIRECT_MAX_BYTES or p == 1)):
        direct.run(op, spec.root, views, reducing, spec.count)
        return Outcome(algorithm=DIRECT, chunks=1, seconds=task.elapsed())
    if algorithm:
        chunks = chunks_for(algorithm, p, task.nbytes, LOCAL_LINK, op=op)
    else:
        choice = select(op, task.nbytes, p, LOCAL_LINK)
        algorithm, chunks = choice.algorithm, choice.chunks
    # The views' addresses are part of the key (same handle, other offset: other plan);
    # the handles come last so that forget() finds the groups of a released buffer.
    key = (
        spec,
        algorithm,
        chunks,
        tuple(arr.__array_interface__["data"][0] for pair in views for arr in pair),
        tuple(h for a in task.arrivals for h in a.handles),
    )

    def build() -> LocalGroup:
        return LocalGroup(generate(op, algorithm, p, spec.count, spec.root, chunks), views, reducing)

    task.job.plans.get(key, build).run(task.timeout)
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed())


def _on_devices(task: Task, devices: DeviceRegistry) -> Outcome:
    """A collective over device spans: the chain ordered by topology, run on streams."""
    spec, op, p = task.spec, task.op, task.participants
    algorithm, chunks = device_schedule(op, spec.algorithm, p, task.nbytes, DEVICE_LINK)
    views = cast("list[tuple[Span, Span]]", [buffers(spec, a, p) for a in task.arrivals])  # on_device
    order = device_chain(op, spec.root, [inp.device for inp, _ in views], devices.context.topology)
    key = (
        spec,
        algorithm,
        chunks,
        "device",
        tuple((pair[0].lo, pair[1].lo) for pair in views),
        tuple(h for a in task.arrivals for h in a.handles),
    )

    def build() -> DeviceGroup:
        schedule = generate(op, algorithm, p, spec.count, order.index(spec.root), chunks)
        return DeviceGroup(
            devices.context, schedule, [views[r] for r in order], reduction(spec, task.dtype, p)
        )

    group = task.job.plans.get(key, build)
    busy = devices.use([span.memory for pair in views for span in pair])
    try:
        # A failed run returns only once its streams drained: the error is answered after
        # the last write into the clients' memory, and the mappings close after that.
        group.run(time.monotonic() + task.timeout, [task.arrivals[r].ready for r in order])
    finally:
        devices.done(busy)
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed())


def device_schedule(
    op: Collective, forced: str, participants: int, nbytes: int, model: LinkModel
) -> tuple[str, int]:
    """(algorithm, chunks) of a collective on device buffers: the forced one, else the
    tuner's pick for ``model``; never direct (a host-buffer path)."""
    if forced == DIRECT:
        raise InvalidArgumentError(
            "algorithm='direct' serves host buffers; device buffers run lp, ring, mst, be "
            "or the tuner's choice"
        )
    if forced:
        return forced, chunks_for(forced, participants, nbytes, model, op=op)
    choice = select(op, nbytes, participants, model)
    return choice.algorithm, choice.chunks


def device_chain(op: Collective, root: int, devices: list[int], topology: Topology) -> list[int]:
    """Ranks in schedule order: for broadcast, reduce and allreduce the chain over the
    devices with the fewest slow crossings (a broadcast's root heads it, a reduce's root
    ends it); the blocked collectives keep rank order (their blocks are rank-indexed)."""
    if op in BLOCKED:
        return list(range(len(devices)))
    links = [[int(x) for x in row] for row in topology.links]
    return chain_order(
        devices,
        links,
        first=root if op is Collective.BROADCAST else None,
        last=root if op is Collective.REDUCE else None,
    )
