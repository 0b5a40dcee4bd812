"""The "run" stage of a multi-node collective on device buffers: one pipeline, three stages.

    devices ==(device chain: reduce)==> boundary --D2H--> ring slot (pinned host)
        ring slot <==(the pipeline across the nodes' boundaries, peer plane)==> ring slot
    ring slot --H2D--> boundary ==(device chain: broadcast)==> devices

Allreduce, reduce and broadcast take it when every node's participants pass device
buffers (each node offers its segment size in its agreement summary; the verdict carries
the smallest, or none when a node has host buffers: then every node runs the flat
pipeline over host mirrors, staging.py). On each node one participant is the boundary:
the root where it is on this node, else the first local rank. Inside the node the local
stages run on the device engine (DeviceGroup: peer copies and reductions on the daemon's
streams, the chain ordered by topology), so the node's devices talk to each other and
only the boundary's bytes cross host memory.

The message goes in segments of ``staging_bytes / RING_SLOTS`` bytes through a ring of
RING_SLOTS pinned host slots per job (the bound on host memory, whatever the message's
size). While the peer plane carries segment k (its own chunked pipeline, one participant
per node), the device streams reduce and copy out segments k+1..k+RING_SLOTS-1 and
broadcast segment k-1: no stage waits for the whole message. The device groups of the
segments share their staging memory (Scratch) and each is queued behind the previous one
(its streams wait for the previous group's final events), so they never overlap.

Sums are taken locally without averaging; the cross-node stage divides by the world size
(avg). Plans (every segment's groups, tags and copies) are built once per (spec, buffers,
schedule, mesh) and reused.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.registry import DIRECT, algorithms_for
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.collectives import local
from lpsync.daemon.collectives.small import rides
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.plane import Link
from lpsync.engine.device_group import DeviceGroup, Scratch
from lpsync.engine.group import LocalGroup
from lpsync.engine.routing import Placement
from lpsync.engine.staging import HostMirrors
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.types import Collective

HIERARCHICAL = frozenset({Collective.ALLREDUCE, Collective.REDUCE, Collective.BROADCAST})
RING_SLOTS = 4  # pinned host slots per job: a segment on the wire, the next ones filling
_STEP_BITS = 20  # planning.py's tag layout: every segment's steps share these bits
_PATIENCE = 3600.0  # a failed run waits this long at most for its queued copies


def offer(task: Task, devices: DeviceRegistry | None) -> tuple[tuple[str, int], ...]:
    """This node's summary field: the segment size it runs hierarchically ("device"), or
    nothing (host buffers, another op, a small collective)."""
    if devices is None or not task.on_device or task.op not in HIERARCHICAL or rides(task):
        return ()
    return (("device", max(4096, devices.staging_bytes // RING_SLOTS)),)


@dataclass
class _Segment:
    lo: int
    hi: int
    gather: DeviceGroup | None  # the local reduce onto the boundary
    source: Span | None  # what goes down to the ring slot (None: nothing to send)
    ring: Span  # the segment in its ring slot
    cross: LocalGroup
    tag: int  # offset of this segment's messages in the collective's tag space
    result: Span | None  # where the slot's bytes go back up (None: nothing comes back)
    spread: DeviceGroup | None  # the local broadcast from the boundary
    staged: Any  # event: the slot holds the segment
    returned: Any  # event: the segment is back on the boundary


class Hierarchy:
    """Every segment's plan over one set of buffers; ``close`` gives back what it holds."""

    def __init__(
        self, segments: list[_Segment], scratch: Scratch, ring: HostMirrors, stream: Any, done: Any
    ) -> None:
        self.segments, self.scratch, self.ring = segments, scratch, ring
        self.stream, self.done = stream, done  # the boundary's copy stream, an event of it
        self.algorithm = segments[0].cross.schedule.algorithm if segments else DIRECT
        self.chunks = sum(s.cross.schedule.chunks for s in segments)

    def close(self, wait: bool = True) -> None:
        for cross in {id(s.cross): s.cross for s in self.segments}.values():
            cross.close(wait)
        for segment in self.segments:
            for group in (segment.gather, segment.spread):
                if group is not None:
                    group.close()
        self.scratch.close()


def run(
    task: Task, link: Link, devices: DeviceRegistry, segment_bytes: int, deadline: float, tags: int
) -> tuple[str, int]:
    """Run the collective hierarchically; (algorithm across nodes, chunks in all)."""
    model = link.model
    assert model is not None
    ring = _ring(task, devices, segment_bytes)
    plan = _plan(task, link, devices, ring, segment_bytes // task.dtype.itemsize, model)
    _run(plan, task, devices, deadline, tags)
    return plan.algorithm, plan.chunks


def _ring(task: Task, devices: DeviceRegistry, segment_bytes: int) -> HostMirrors:
    """The job's RING_SLOTS pinned slots (portable: any device copies through them)."""
    first = task.arrivals[0].data
    slot = Span(first.memory, 0, segment_bytes, np.dtype(np.uint8))
    return task.job.plans.mirrors(
        ("ring", segment_bytes, ()), lambda: HostMirrors(devices.kind, [slot] * RING_SLOTS)
    )


def _choose(
    op: Collective, algorithm: str, participants: int, nbytes: int, model: LinkModel
) -> tuple[str, int]:
    if algorithm == DIRECT:
        raise InvalidArgumentError(
            "algorithm='direct' serves host buffers; device buffers run lp, ring, mst, be "
            "or the tuner's choice"
        )
    if algorithm:
        return algorithm, chunks_for(algorithm, participants, nbytes, model, op=op)
    choice = select(op, nbytes, participants, model)
    return choice.algorithm, choice.chunks


def _plan(
    task: Task, link: Link, devices: DeviceRegistry, ring: HostMirrors, per: int, model: LinkModel
) -> Hierarchy:
    spec, op, itemsize = task.spec, task.op, task.dtype.itemsize
    layout = task.job.layout
    assert layout is not None
    count = spec.count
    lengths = sorted({min(per, count - lo) for lo in range(0, count, per)})
    # Every node resolves the same schedule per segment length (agreed model and size).
    across = {n: _choose(op, spec.algorithm, layout.nodes, n * itemsize, model) for n in lengths}
    views = [buffers(spec, a, task.participants) for a in task.arrivals]
    key = (
        spec,
        "hierarchy",
        per,
        tuple(sorted(across.items())),
        link.generation,
        ring.serial,
        tuple((i.lo, o.lo) for i, o in views),
        tuple(h for a in task.arrivals for h in a.handles),
    )
    return task.job.plans.get(key, lambda: _build(task, link, devices, ring, per, across, views))


def _build(
    task: Task,
    link: Link,
    devices: DeviceRegistry,
    ring: HostMirrors,
    per: int,
    across: dict[int, tuple[str, int]],
    views: list[tuple[Span, Span]],
) -> Hierarchy:
    spec, op, dtype = task.spec, task.op, task.dtype
    layout = task.job.layout
    assert layout is not None
    context, kind = devices.context, devices.kind
    ranks = [a.rank for a in task.arrivals]
    rooted = op is not Collective.ALLREDUCE
    b = ranks.index(spec.root) if rooted and spec.root in ranks else 0  # the boundary
    holds_root = not rooted or spec.root in ranks
    on = [inp.device for inp, _ in views]
    topology = context.topology
    gather_order = local.device_chain(Collective.REDUCE, b, on, topology)
    spread_order = local.device_chain(Collective.BROADCAST, b, on, topology)
    several = len(views) > 1
    scratch = Scratch(context.pool)
    placement = Placement.of(range(layout.nodes), layout.node)
    cross_root = layout.node_of[spec.root] if rooted else 0
    summing = reduction(spec, dtype, 1)  # locally: no division (avg divides once, across)
    segments: list[_Segment] = []
    crosses: dict[tuple[int, int], LocalGroup] = {}
    tag = 0
    try:
        for k, lo in enumerate(range(0, spec.count, per)):
            hi = min(spec.count, lo + per)
            n = hi - lo
            mine = [(i[lo:hi], o[lo:hi]) for i, o in views]
            inp, out = mine[b]
            gather = spread = None
            source: Span | None
            result: Span | None = out if holds_root or op is Collective.BROADCAST else None
            if op is Collective.BROADCAST:
                source = inp if holds_root else None
            elif several:
                # A reduce's non-root boundary keeps its partial sum off the caller's buffer:
                # in device scratch, one per ring slot (a slot's copy-out reads it).
                target = out
                if not holds_root:
                    memory = scratch.take(("partial", k % RING_SLOTS), on[b], n * dtype.itemsize)
                    target = Span(memory, 0, n, dtype)
                gathered = list(mine)
                gathered[b] = (inp, target)
                gather = _device_group(
                    devices, Collective.REDUCE, spec.algorithm, gather_order, b, gathered, summing, scratch
                )
                source = target
            else:
                source = inp
            if op is not Collective.REDUCE and several:
                spreading = list(mine)
                spreading[b] = (out, out)  # the boundary's result is in its output by then
                spread = _device_group(
                    devices, Collective.BROADCAST, spec.algorithm, spread_order, b, spreading, None, scratch
                )
            if (
                op is Collective.BROADCAST
                and result is not None
                and source is not None
                and result.lo == source.lo
            ):
                result = None  # a broadcast's root in place: its bytes never changed
            host = ring.mirrors[k % RING_SLOTS]
            assert host is not None
            cross = crosses.get((k % RING_SLOTS, n))
            if cross is None:  # one per (slot, length): its receive window is host memory too
                array = host.array.view(dtype)[:n]
                algorithm, chunks = across[n]
                cross = crosses[k % RING_SLOTS, n] = LocalGroup(
                    generate(op, algorithm, layout.nodes, n, cross_root, chunks),
                    [(array, array)],
                    reduction(spec, dtype, task.participants),
                    placement,
                    link.endpoint,
                )
            schedule = cross.schedule
            segments.append(
                _Segment(
                    lo=lo,
                    hi=hi,
                    gather=gather,
                    source=source,
                    ring=Span(host.host, 0, n, dtype),
                    cross=cross,
                    tag=tag,
                    result=result,
                    spread=spread,
                    staged=kind.event(on[b]),
                    returned=kind.event(on[b]),
                )
            )
            tag += (int(schedule.tags.max()) + 1) if schedule.tags.size else 1
        if tag > 1 << _STEP_BITS:
            raise InvalidArgumentError(
                f"{spec.count} elements in {len(segments)} segments need more than "
                f"2**{_STEP_BITS} messages per pair: raise --device-staging-bytes"
            )
    except BaseException:
        Hierarchy(segments, scratch, ring, None, None).close(wait=False)
        raise
    return Hierarchy(segments, scratch, ring, context.stream(on[b], 0, "boundary"), kind.event(on[b]))


def _device_group(
    devices: DeviceRegistry,
    op: Collective,
    forced: str,
    order: list[int],
    root: int,
    views: list[tuple[Span, Span]],
    reducing: Any,
    scratch: Scratch,
) -> DeviceGroup:
    """The local stage over ``views`` (participant order), chained as ``order`` says."""
    nbytes = views[0][0].nbytes
    # The forced algorithm is the nodes' schedule; inside the node it runs where it has
    # this stage's op (ring has no reduce), else the tuner picks for the device link.
    forced = forced if forced in algorithms_for(op) else ""
    algorithm, chunks = _choose(op, forced, len(views), nbytes, local.DEVICE_LINK)
    schedule = generate(op, algorithm, len(views), views[0][0].count, order.index(root), chunks)
    return DeviceGroup(devices.context, schedule, [views[r] for r in order], reducing, scratch)


def _run(plan: Hierarchy, task: Task, devices: DeviceRegistry, deadline: float, tags: int) -> None:
    kind, lock, stream = devices.kind, devices.context.enqueue_lock, plan.stream
    for a in task.arrivals:
        if a.ready is not None:  # polled: the shared streams never wait on a client
            kind.wait_ready(a.ready, deadline)
    busy = devices.use([span.memory for a in task.arrivals for span in (a.data, a.out) if span is not None])
    plan.ring.acquire()
    queued: list[DeviceGroup] = []
    fence: list[Any] = []  # the last queued device group's final events

    def on_devices(group: DeviceGroup, after: list[Any]) -> None:
        nonlocal fence
        group.enqueue(after=fence + after)
        fence = list(group.finals)
        queued.append(group)

    def down(segment: _Segment) -> None:
        """Reduce segment k onto the boundary and copy it into its ring slot."""
        if segment.gather is not None:
            on_devices(segment.gather, [])
        with lock:
            if segment.source is not None:
                for event in fence if segment.gather is not None else ():
                    kind.wait(stream, event)
                kind.copy_async(segment.ring, segment.source, stream)
            kind.record(segment.staged, stream)

    segments = plan.segments
    try:
        for segment in segments[:RING_SLOTS]:
            down(segment)
        for k, segment in enumerate(segments):
            kind.synchronize(segment.staged, deadline)
            segment.cross.run(max(0.0, deadline - time.monotonic()), tags + segment.tag)
            with lock:
                if segment.result is not None:
                    kind.copy_async(segment.result, segment.ring, stream)
                kind.record(segment.returned, stream)
            if segment.spread is not None:
                on_devices(segment.spread, [segment.returned])
            if k + RING_SLOTS < len(segments):
                down(segments[k + RING_SLOTS])  # into this slot: after its copy back (one stream)
        if segments:
            kind.synchronize(segments[-1].returned, deadline)
        if queued:
            queued[-1].wait(deadline)  # fenced: the last group's end is every group's end
    except BaseException:
        # Nothing queued may touch the clients' memory once the error is answered.
        for group in queued:
            group.drain()
            group.recover()
        _drain(kind, lock, stream, plan.done)
        raise
    finally:
        devices.done(busy)
        plan.ring.release()


def _drain(kind: Any, lock: Any, stream: Any, event: Any) -> None:
    """Until the boundary's copies queued so far ran (their errors ignored: the run's own
    failure is what is reported), then clear the stream's error where the kind can."""
    with contextlib.suppress(Exception):
        with lock:
            kind.record(event, stream)
        kind.synchronize(event, time.monotonic() + _PATIENCE)
    recover = getattr(kind, "recover", None)
    if recover is not None:
        recover(stream)
