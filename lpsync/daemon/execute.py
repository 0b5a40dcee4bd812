"""Running a matched collective over the participants' shared-memory views.

Two paths, chosen per collective and identical on every participant:
  * direct (messages up to DIRECT_MAX_BYTES = 2 MiB, P == 1, barrier, or
    algorithm="direct"):
    the last participant's thread reduces the P views in rank order into a scratch
    array and writes every output. One pass, no thread hand-offs: this is what keeps
    a 4-byte allreduce close to a bare gRPC round trip. Deterministic: the order of
    the reduction is fixed, so every participant and every run get the same bits.
  * pipelined (everything else): the tuner picks an algorithm and chunk count for
    local memory (or ``algorithm=`` forces one) and the engine's LocalGroup runs the
    schedule with one thread per participant over the zero-copy inproc transport.
    LocalGroups are cached per (spec, buffers) and reused: plan once, run many.
Invariants: inputs of out-of-place collectives are only read; a non-root's buffer of
reduce is never written.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.chain_order import chain_order
from lpsync.algorithms.cost import busbw_factor
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.devices import DeviceRegistry
from lpsync.daemon.matching import Arrival, Job, Outcome, Pending
from lpsync.engine.device_group import DeviceGroup
from lpsync.engine.group import LocalGroup, layout
from lpsync.engine.reduce import Reduction
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span, Topology
from lpsync.types import Collective, ReduceOp, dtype_of

# Measured (docs/benchmarks.md, 4 ranks on 2 cores): one thread reducing every view beats
# the thread-per-participant schedules up to 2 MiB; be/lp win from 4 MiB on.
DIRECT_MAX_BYTES = 2 * 1024 * 1024
# Local memory as the tuner sees it: a thread hand-off per message, memcpy bandwidth,
# and a link of its own between every pair of participants (no shared NIC).
LOCAL_LINK = LinkModel.from_bandwidth(alpha=30e-6, bandwidth=8e9, shared_nic=False)
# Device memory as the tuner sees it: a stream operation's launch and an NVLink-class
# copy; every pair of devices has links of its own.
DEVICE_LINK = LinkModel.from_bandwidth(alpha=10e-6, bandwidth=100e9, shared_nic=False)
_CACHE_SIZE = 8
BARRIER = "barrier"
DIRECT = "direct"
_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)


def nccl_bytes(op: str, count: int, itemsize: int, participants: int) -> int:
    """nccl-tests' "size": the whole buffer (the gathered output, the scattered input)."""
    if op in (Collective.ALLGATHER, Collective.REDUCE_SCATTER):
        return count * itemsize * participants
    return count * itemsize


def bus_factor(op: str, participants: int) -> float:
    return 1.0 if op == BARRIER else busbw_factor(Collective(op), participants)


class GroupCache:
    """LocalGroups of one job, least recently used evicted (their threads shut down)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: OrderedDict[tuple, LocalGroup] = OrderedDict()
        # Multi-node device collectives: host mirrors of device spans (device_staging.py),
        # keyed by the spans' addresses and, last, their handles (so ``forget`` finds them).
        self.staging: OrderedDict[tuple, Any] = OrderedDict()

    def mirrors(self, key: tuple, make):
        """The mirrors under ``key``, made on first use; the least recently used beyond
        _CACHE_SIZE are closed (they free themselves once no run uses them)."""
        with self._lock:
            found = self.staging.get(key)
            if found is not None:
                self.staging.move_to_end(key)
                return found
        made = make()
        with self._lock:
            self.staging[key] = made
            evicted = [self.staging.popitem(last=False)[1] for _ in range(len(self.staging) - _CACHE_SIZE)]
        for old in evicted:
            old.close()
        return made

    def get(self, key: tuple, build):
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
                return group
        group = build()
        evicted = []
        with self._lock:
            self._groups[key] = group
            while len(self._groups) > _CACHE_SIZE:
                evicted.append(self._groups.popitem(last=False)[1])
        for old in evicted:
            old.close(wait=False)
        return group

    def forget(self, session_id: str, handle: int) -> None:
        """Drop the groups bound to a released buffer, so its memory can be unmapped."""
        with self._lock:
            stale = [k for k in self._groups if (session_id, handle) in k[-1]]
            groups = [self._groups.pop(k) for k in stale]
            mirrors = [self.staging.pop(k) for k in list(self.staging) if (session_id, handle) in k[-1]]
        for group in groups:
            group.close(wait=False)  # may run on the event loop: never wait for a schedule
        for mirror in mirrors:
            mirror.close()  # frees once the run using it ended

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
            mirrors = list(self.staging.values())
            self.staging.clear()
        for group in groups:
            group.close(wait=False)
        for mirror in mirrors:
            mirror.close()


def is_direct(spec, participants: int) -> bool:
    """Whether ``run`` takes the direct path for this spec (decided the same way there)."""
    if spec.op == BARRIER or spec.algorithm == DIRECT:
        return True
    if spec.algorithm:
        return False
    itemsize = dtype_of(spec.dtype).itemsize
    return participants == 1 or nccl_bytes(spec.op, spec.count, itemsize, participants) <= DIRECT_MAX_BYTES


def is_inline(spec, participants: int) -> bool:
    """Whether the event loop may run this collective itself: the direct path and small
    (``algorithm="direct"`` on a big buffer is direct but long: it goes to a worker)."""
    if spec.op == BARRIER:
        return True
    if not is_direct(spec, participants):
        return False
    return nccl_bytes(spec.op, spec.count, dtype_of(spec.dtype).itemsize, participants) <= DIRECT_MAX_BYTES


def run(job: Job, pending: Pending, devices: DeviceRegistry | None = None) -> Outcome:
    """The Runner of matching.py: run ``pending`` (all participants arrived, specs agree)."""
    spec = pending.spec
    arrivals = [pending.arrivals[r] for r in range(job.world_size)]
    start = time.perf_counter()
    if spec.op == BARRIER:
        return Outcome(algorithm=DIRECT, chunks=1, seconds=time.perf_counter() - start)
    op, dtype, p = Collective(spec.op), dtype_of(spec.dtype), job.world_size
    buffers = [_buffers(op, a, p, spec.count) for a in arrivals]
    reduction = Reduction(ReduceOp(spec.reduce_op), dtype, p) if op in _REDUCING else None
    on_device = [isinstance(a.data, Span) for a in arrivals]
    if any(on_device):
        if not all(on_device) or devices is None:
            raise InvalidArgumentError(
                "every participant of a collective must pass device buffers, or none: ranks "
                f"{[r for r, d in enumerate(on_device) if not d]} passed host memory"
            )
        return run_on_devices(job, spec, arrivals, buffers, reduction, devices, start)
    nbytes = nccl_bytes(op, spec.count, dtype.itemsize, p)
    algorithm = spec.algorithm
    if algorithm == DIRECT or (not algorithm and (nbytes <= DIRECT_MAX_BYTES or p == 1)):
        _direct(op, spec.root, buffers, reduction, spec.count)
        return Outcome(algorithm=DIRECT, chunks=1, seconds=time.perf_counter() - start)
    if algorithm:
        chunks = chunks_for(algorithm, p, nbytes, LOCAL_LINK, op=op)
    else:
        choice = select(op, nbytes, p, LOCAL_LINK)
        algorithm, chunks = choice.algorithm, choice.chunks
    if job.cache is None:
        job.cache = GroupCache()
    # The views' addresses are part of the key (same handle, other offset: other plan);
    # the handles come last so that forget() finds the groups of a released buffer.
    key = (
        spec,
        algorithm,
        chunks,
        tuple(arr.__array_interface__["data"][0] for pair in buffers for arr in pair),
        tuple(h for a in arrivals for h in a.handles),
    )

    def build() -> LocalGroup:
        schedule = generate(op, algorithm, p, spec.count, spec.root, chunks)
        return LocalGroup(schedule, buffers, reduction)

    group = job.cache.get(key, build)
    group.run(min(a.timeout for a in arrivals))
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=time.perf_counter() - start)


def run_on_devices(
    job: Job, spec, arrivals: list[Arrival], buffers: list, reduction, devices: DeviceRegistry, start: float
) -> Outcome:
    """A collective over device spans: the chain ordered by topology, run on streams."""
    op, p = Collective(spec.op), job.world_size
    nbytes = nccl_bytes(op, spec.count, dtype_of(spec.dtype).itemsize, p)
    algorithm = spec.algorithm
    if algorithm == DIRECT:
        raise InvalidArgumentError(
            "algorithm='direct' serves host buffers; device buffers "
            "run lp, ring, mst, be or the tuner's choice"
        )
    if algorithm:
        chunks = chunks_for(algorithm, p, nbytes, DEVICE_LINK, op=op)
    else:
        choice = select(op, nbytes, p, DEVICE_LINK)
        algorithm, chunks = choice.algorithm, choice.chunks
    order = device_chain(op, spec.root, [inp.device for inp, _ in buffers], devices.kind.topology)
    if job.cache is None:
        job.cache = GroupCache()
    key = (
        spec,
        algorithm,
        chunks,
        "device",
        tuple((pair[0].lo, pair[1].lo) for pair in buffers),
        tuple(h for a in arrivals for h in a.handles),
    )

    def build() -> DeviceGroup:
        schedule = generate(op, algorithm, p, spec.count, order.index(spec.root), chunks)
        return DeviceGroup(devices.context, schedule, [buffers[r] for r in order], reduction)

    group = job.cache.get(key, build)
    busy = devices.use([span.memory for pair in buffers for span in pair])
    try:
        group.run(time.monotonic() + min(a.timeout for a in arrivals), [arrivals[r].ready for r in order])
    except BaseException:
        # The streams may still be running (a timeout): free the allocations only once
        # they have drained, off this thread.
        threading.Thread(
            target=_drain_then_done, args=(group, devices, busy), daemon=True, name="lpsync-device-drain"
        ).start()
        raise
    devices.done(busy)
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=time.perf_counter() - start)


def _drain_then_done(group: DeviceGroup, devices: DeviceRegistry, busy: list) -> None:
    try:
        group.drain()
        group.recover()
    finally:
        devices.done(busy)


def device_chain(op: Collective, root: int, devices: list[int], topology: Topology) -> list[int]:
    """Ranks in schedule order: for broadcast, reduce and allreduce the chain over the
    devices with the fewest slow crossings (a broadcast's root heads it, a reduce's root
    ends it); allgather and reduce_scatter keep rank order (their blocks are rank-indexed)."""
    if op in (Collective.ALLGATHER, Collective.REDUCE_SCATTER):
        return list(range(len(devices)))
    links = [[int(x) for x in row] for row in topology.links]
    return chain_order(
        devices,
        links,
        first=root if op is Collective.BROADCAST else None,
        last=root if op is Collective.REDUCE else None,
    )


def _buffers(op: Collective, arrival: Arrival, p: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    assert arrival.data is not None
    if arrival.out is None:
        return layout(op, arrival.rank, p, count, arrival.data, in_place=True)
    return arrival.data, arrival.out


def _direct(
    op: Collective,
    root: int,
    buffers: list[tuple[np.ndarray, np.ndarray]],
    reduction: Reduction | None,
    count: int,
) -> None:
    if op is Collective.BROADCAST:
        source = buffers[root][0]
        for _, out in buffers:
            if out is not source:
                np.copyto(out, source)
        return
    if op is Collective.ALLGATHER:
        for _, out in buffers:
            for q, (inp, _) in enumerate(buffers):
                block = out[q * count : (q + 1) * count]
                if not np.shares_memory(block, inp):
                    np.copyto(block, inp)
        return
    assert reduction is not None
    # Reduce into a scratch array first: in place, the inputs are also the outputs.
    acc = buffers[0][0].copy()
    for inp, _ in buffers[1:]:
        reduction.combine(acc, inp, acc)
    reduction.finalize(acc)
    if op is Collective.ALLREDUCE:
        for _, out in buffers:
            np.copyto(out, acc)
    elif op is Collective.REDUCE:
        np.copyto(buffers[root][1], acc)
    else:  # reduce_scatter
        for rank, (_, out) in enumerate(buffers):
            np.copyto(out, acc[rank * count : (rank + 1) * count])
