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
RING_SLOTS pinned host slots, leased for the run from the daemon's pool (DeviceRegistry.rings:
bounded in bytes for the whole daemon, whatever the message's size or the number of jobs).
While the peer plane carries segment k (its own chunked pipeline, one participant per
node), the device streams reduce and copy out segments k+1..k+RING_SLOTS-1 and broadcast
segment k-1: no stage waits for the whole message. The device groups of the
segments share their staging memory (Scratch) and each is queued behind the previous one
(its streams wait for the previous group's final events), so they never overlap.

Where the peer plane takes device memory itself (the daemon's device path is ``device``:
UCX with its cuda transports, lpsync/transport/ucx/device_support.py), the ring is on the
device, no host memory:

    devices ==(device chain: reduce)==> boundary --D2D--> device slot (the daemon's own)
        device slot <==(peer plane, device chunks)==> device slot
    device slot --D2D--> boundary ==(device chain: broadcast)==> devices

each segment crosses the nodes from a device slot the daemon allocated (DeviceRing, leased
like the host ring from DeviceRegistry.device_rings), never from a client's IPC-mapped
buffer: UCX's registration cache is not told when an IPC mapping closes. Chunks received
to be reduced land in device slots and are reduced on the boundary's stream
(lpsync.engine.buffers.DeviceBuffers). The segments, schedules and tags are the same
either way, so nodes that stage and nodes that do not interoperate.

Sums are taken locally without averaging; the cross-node stage divides by the world size
(avg). Plans (every segment's groups, tags and copies) are built once per (spec, buffers,
schedule, mesh) and reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

from lpsync.algorithms import LinkModel, generate
from lpsync.algorithms.registry import DIRECT, algorithms_for
from lpsync.daemon.collectives import local
from lpsync.daemon.collectives.agreement import Verdict
from lpsync.daemon.collectives.packed import PACKED
from lpsync.daemon.collectives.plans import ClosedWhenIdle
from lpsync.daemon.collectives.small import rides
from lpsync.daemon.collectives.staging import RING_SLOTS, drain
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.plane import Link
from lpsync.engine.buffers import DeviceBuffers
from lpsync.engine.device_group import DeviceGroup, Lanes, Scratch
from lpsync.engine.group import LocalGroup
from lpsync.engine.routing import Placement
from lpsync.engine.staging import DeviceRing, HostMirrors
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.transport.tags import STEP_BITS
from lpsync.types import Collective

HIERARCHICAL = frozenset(
    {
        Collective.ALLREDUCE,
        Collective.REDUCE,
        Collective.BROADCAST,
        Collective.ALLGATHER,
        Collective.REDUCE_SCATTER,
    }
)


def offer(task: Task, devices: DeviceRegistry | None) -> tuple[tuple[str, int], ...]:
    """This node's summary field: the segment size it runs hierarchically ("device"), or
    nothing (host buffers, another op, a small collective)."""
    if devices is None or not task.on_device or task.op not in HIERARCHICAL | PACKED or rides(task):
        return ()
    return (("device", max(4096, devices.staging_bytes // RING_SLOTS)),)


@dataclass
class _Segment:
    gather: DeviceGroup | None  # the local reduce onto the boundary
    source: Span | None  # what is copied to ``across`` first (None: nothing)
    across: Span  # where the segment crosses the nodes: its ring slot (host, or device: direct)
    cross: LocalGroup
    tag: int  # offset of this segment's messages in the collective's tag space
    steps: int  # tags this segment's messages take
    result: Span | None  # where ``across`` is copied back to (None: nothing comes back)
    spread: DeviceGroup | None  # the local broadcast from the boundary
    boundary: int  # the boundary participant's device
    stream: Any  # its copy stream (to and from the ring)
    staged: Any  # event: the slot holds the segment
    returned: Any  # event: the segment is back on the boundary


class Hierarchy(ClosedWhenIdle):
    """Every segment's plan over one set of buffers; ``close`` gives back what it holds
    (once the run under way, if any, ended)."""

    def __init__(
        self,
        segments: list[_Segment],
        scratch: Scratch,
        ring: Ring,
        lanes: list,
        direct: dict[int, DeviceBuffers],
        streams: Lanes,
    ) -> None:
        super().__init__()
        self.segments, self.scratch, self.ring, self.streams = segments, scratch, ring, streams
        self.direct = direct  # per boundary device: the cross stage's device scratch
        self.lanes = lanes  # (stream, event) of each boundary device's copy stream
        self.algorithm = segments[0].cross.schedule.algorithm if segments else DIRECT
        self.chunks = sum(s.cross.schedule.chunks for s in segments)

    def _close(self, wait: bool) -> None:
        for cross in {id(s.cross): s.cross for s in self.segments}.values():
            cross.close(wait)
        for segment in self.segments:
            for group in (segment.gather, segment.spread):
                if group is not None:
                    group.close()
        for memory in self.direct.values():
            memory.close()
        self.scratch.close()
        self.streams.close()  # its runs ended: nothing is queued on them any more


def run(
    task: Task,
    link: Link,
    devices: DeviceRegistry,
    verdict: Verdict,
    deadline: float,
    tags: int,
) -> tuple[str, int]:
    """Run the collective hierarchically: the verdict's segment size and link model
    (every node's, so every node builds the same schedules); returns (algorithm across
    nodes, chunks in all)."""
    segment_bytes, model = verdict.segment, verdict.model
    # The segments cross through a ring the job leases from the daemon's pools (bounded
    # for the daemon, not per job) and gives back once this run's streams drained (_run
    # drains on a failure too): pinned host slots, or, where UCX sends device memory
    # itself (each node decides for its own side), device slots of the daemon's own on
    # each boundary device.
    owner = (task.job.name, "hierarchy")
    pool = devices.device_rings if devices.peer_direct else devices.rings
    places = _boundaries(task) if devices.peer_direct else [cast(Span, task.arrivals[0].data).device]
    rings = pool.lease(owner, segment_bytes, places, deadline)
    try:
        ring = Ring(None if devices.peer_direct else rings[0], dict(zip(places, rings, strict=True)))
        plan = _plan(task, link, devices, ring, segment_bytes // task.dtype.itemsize, model)
        _run(plan, task, devices, deadline, tags)
    finally:
        pool.give_back(rings, owner)
    return plan.algorithm, plan.chunks


@dataclass(frozen=True)
class Ring:
    """Where a run's segments cross: ``host``'s pinned slots (staged), or the daemon's own
    device slots on each boundary device (``device``: the direct path)."""

    host: HostMirrors | None
    device: dict[int, DeviceRing]

    @property
    def serial(self) -> tuple[int, ...]:
        return (self.host.serial,) if self.host is not None else tuple(r.serial for r in self.device.values())


def _boundaries(task: Task) -> list[int]:
    """The devices of this node's boundaries, one per part (the root's, where this node
    has it, else the first local rank's): where the direct path's device slots go."""
    ranks = [a.rank for a in task.arrivals]
    on = [cast(Span, a.data).device for a in task.arrivals]
    if task.op is Collective.ALLREDUCE:
        return [on[0]]
    roots = (
        [task.spec.root] if task.op in (Collective.REDUCE, Collective.BROADCAST) else range(task.participants)
    )
    return sorted({on[ranks.index(r)] if r in ranks else on[0] for r in roots})


@dataclass(frozen=True)
class _Part:
    """One rooted (or all-reduced) collective over sub-spans: allgather is P broadcasts of
    the ranks' blocks, reduce_scatter P reduces, the others one part of their own."""

    op: Collective  # ALLREDUCE, REDUCE or BROADCAST
    root: int  # a rank (ALLREDUCE: unused)
    views: list[tuple[Span, Span]]  # (in, out) of each local participant


def _parts(task: Task, views: list[tuple[Span, Span]]) -> list[_Part]:
    spec, op, count = task.spec, task.op, task.spec.count
    if op in (Collective.ALLREDUCE, Collective.REDUCE, Collective.BROADCAST):
        return [_Part(op, spec.root, views)]
    ranks = [a.rank for a in task.arrivals]
    parts = []
    for r in range(task.participants):
        block = slice(r * count, (r + 1) * count)
        if op is Collective.ALLGATHER:  # rank r's block from r to everyone's output
            mine = [
                (i, o[block]) if q == r else (o[block], o[block])
                for q, (i, o) in zip(ranks, views, strict=True)
            ]
            parts.append(_Part(Collective.BROADCAST, r, mine))
        else:  # REDUCE_SCATTER: everyone's block r reduced into r's output
            mine = [
                (i[block], o) if q == r else (i[block], i[block])
                for q, (i, o) in zip(ranks, views, strict=True)
            ]
            parts.append(_Part(Collective.REDUCE, r, mine))
    return parts


def _plan(
    task: Task, link: Link, devices: DeviceRegistry, ring: Ring, per: int, model: LinkModel
) -> Hierarchy:
    spec, itemsize = task.spec, task.dtype.itemsize
    layout = task.job.layout
    assert layout is not None
    views = cast("list[tuple[Span, Span]]", [buffers(spec, a, task.participants) for a in task.arrivals])
    parts = _parts(task, views)
    count = parts[0].views[0][0].count
    lengths = sorted({min(per, count - lo) for lo in range(0, count, per)})
    # Every node resolves the same schedule per (op, segment length): agreed model and
    # size. A forced algorithm runs where it has the part's op (ring has no broadcast).
    across = {
        (part.op, n): local.device_schedule(
            part.op,
            spec.algorithm if spec.algorithm in algorithms_for(part.op) else "",
            layout.nodes,
            n * itemsize,
            model,
        )
        for part in parts
        for n in lengths
    }
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
    return task.job.plans.get(key, lambda: _build(task, link, devices, ring, per, across, parts))


def _build(
    task: Task,
    link: Link,
    devices: DeviceRegistry,
    ring: Ring,
    per: int,
    across: dict[tuple[Collective, int], tuple[str, int]],
    parts: list[_Part],
) -> Hierarchy:
    layout = task.job.layout
    assert layout is not None
    context, kind = devices.context, devices.kind
    scratch = Scratch(context.pool)
    own = Lanes(context, (task.job.name,))
    segments: list[_Segment] = []
    crosses: dict[tuple[Collective, int, int, int, int], LocalGroup] = {}
    direct: dict[int, DeviceBuffers] = {}
    try:
        for part in parts:
            _segments(task, link, devices, ring, per, across, part, scratch, crosses, segments, direct, own)
        tag = sum(s.steps for s in segments)
        if tag > 1 << STEP_BITS:
            raise InvalidArgumentError(
                f"{task.spec.count} elements in {len(segments)} segments need more than "
                f"2**{STEP_BITS} messages per pair: raise --device-staging-bytes"
            )
    except BaseException:
        Hierarchy(segments, scratch, ring, [], direct, own).close(wait=False)
        raise
    boundaries = {id(s.stream): (s.stream, s.boundary) for s in segments}
    lanes = [(stream, kind.event(d)) for stream, d in boundaries.values()]
    lanes += [(memory.stream, memory.done) for memory in direct.values()]  # drained on a failure too
    return Hierarchy(segments, scratch, ring, lanes, direct, own)


def _segments(
    task: Task,
    link: Link,
    devices: DeviceRegistry,
    ring: Ring,
    per: int,
    across: dict[tuple[Collective, int], tuple[str, int]],
    part: _Part,
    scratch: Scratch,
    crosses: dict[tuple[Collective, int, int, int, int], LocalGroup],
    segments: list[_Segment],
    direct: dict[int, DeviceBuffers],
    streams: Lanes,
) -> None:
    """Append ``part``'s segments (their tags after those already there). Without a
    ``ring`` they cross from device memory (``direct``: each boundary device's scratch)."""
    spec, dtype, op, views = task.spec, task.dtype, part.op, part.views
    layout = task.job.layout
    assert layout is not None
    kind, topology = devices.kind, devices.context.topology
    ranks = [a.rank for a in task.arrivals]
    rooted = op is not Collective.ALLREDUCE
    b = ranks.index(part.root) if rooted and part.root in ranks else 0  # the boundary
    holds_root = not rooted or part.root in ranks
    on = [inp.device for inp, _ in views]
    gather_order = local.device_chain(Collective.REDUCE, b, on, topology)
    spread_order = local.device_chain(Collective.BROADCAST, b, on, topology)
    several = len(views) > 1
    placement = Placement.of(range(layout.nodes), layout.node)
    cross_root = layout.node_of[part.root] if rooted else 0
    summing = reduction(spec, dtype, 1)  # locally: no division (avg divides once, across)
    count = views[0][0].count

    def partial(k: int, n: int) -> Span:
        """Device scratch on the boundary for a partial sum that must not land in a
        caller's buffer, one per ring slot index (a slot's segments run one at a time)."""
        memory = scratch.take(("partial", k % RING_SLOTS), on[b], n * dtype.itemsize)
        return Span(memory, 0, n, dtype)

    for lo in range(0, count, per):
        k = len(segments)
        hi = min(count, lo + per)
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
                target = partial(k, n)
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
        slot = k % RING_SLOTS
        algorithm, chunks = across[op, n]
        reducing = reduction(spec, dtype, task.participants) if op is not Collective.BROADCAST else None
        cross: LocalGroup | None
        if ring.host is None:
            # The direct path: the segment crosses from the daemon's own device slot on the
            # boundary (copied there and back on the boundary's stream, as through the host
            # ring): UCX is never handed a client's IPC-mapped memory, whose closing its
            # registration cache does not see, nor memory imported into another process.
            where = ring.device[on[b]].span(slot, n, dtype)
            cross = crosses.get((op, cross_root, slot, n, on[b]))
            if cross is None:  # one per (op, root, slot, length, boundary device)
                memory_of = direct.get(on[b])
                if memory_of is None:  # a stream apart: its reductions never queue behind copies
                    # The job's own stream (not one per device for every job: a slow or dead
                    # job delays only itself) and the plan's own event (a synchronize waits
                    # for this collective's record, not another's later one; dropped with the
                    # plan, it is destroyed on the kind's Releaser, kind.py).
                    memory_of = direct[on[b]] = DeviceBuffers(
                        kind, on[b], streams.get(on[b], "across"), kind.event(on[b]), devices.context.pool
                    )
                # The engine's buffer types name host arrays; a DeviceBuffers memory takes Spans.
                cross = crosses[op, cross_root, slot, n, on[b]] = LocalGroup(
                    generate(op, algorithm, layout.nodes, n, cross_root, chunks),
                    [(where, where)],  # type: ignore[list-item]
                    reducing,
                    placement,
                    link.endpoint,
                    memory_of,
                )
        else:
            host = ring.host.mirrors[slot]
            assert host is not None
            where = Span(host.host, 0, n, dtype)
            cross = crosses.get((op, cross_root, slot, n, -1))
            if cross is None:  # one per (op, root, slot, length): its receive window is host memory too
                array = host.array.view(dtype)[:n]
                cross = crosses[op, cross_root, slot, n, -1] = LocalGroup(
                    generate(op, algorithm, layout.nodes, n, cross_root, chunks),
                    [(array, array)],
                    reducing,
                    placement,
                    link.endpoint,
                )
        schedule = cross.schedule
        segments.append(
            _Segment(
                gather=gather,
                source=source,
                across=where,
                cross=cross,
                tag=sum(s.steps for s in segments),
                steps=(int(schedule.tags.max()) + 1) if schedule.tags.size else 1,
                result=result,
                spread=spread,
                boundary=on[b],
                stream=streams.get(on[b], "boundary"),
                staged=kind.event(on[b]),
                returned=kind.event(on[b]),
            )
        )


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
    algorithm, chunks = local.device_schedule(op, forced, len(views), nbytes, local.DEVICE_LINK)
    schedule = generate(op, algorithm, len(views), views[0][0].count, order.index(root), chunks)
    return DeviceGroup(devices.context, schedule, [views[r] for r in order], reducing, scratch)


def _run(plan: Hierarchy, task: Task, devices: DeviceRegistry, deadline: float, tags: int) -> None:
    kind, lock = devices.kind, devices.context.enqueue_lock
    for a in task.arrivals:
        if a.ready is not None:  # polled: the shared streams never wait on a client
            kind.wait_ready(a.ready, deadline)
    busy = devices.use(
        [cast(Span, span).memory for a in task.arrivals for span in (a.data, a.out) if span is not None]
    )
    plan.acquire()
    queued: list[DeviceGroup] = []
    fence: list[Any] = []  # the last queued device group's final events

    def on_devices(group: DeviceGroup, after: list[Any]) -> None:
        nonlocal fence
        group.enqueue(after=fence + after)
        fence = list(group.finals)
        queued.append(group)

    def down(segment: _Segment, after: _Segment | None) -> None:
        """Reduce a segment onto its boundary and copy it into its ring slot, once the
        slot's previous segment (``after``) was copied back (on another boundary's
        stream, where parts have other roots)."""
        if segment.gather is not None:
            on_devices(segment.gather, [])
        stream = segment.stream
        with lock:
            if after is not None and after.stream is not stream:
                kind.wait(stream, after.returned)
            for event in fence if segment.gather is not None else ():
                kind.wait(stream, event)  # "staged" means reduced onto the boundary too
            if segment.source is not None:
                kind.copy_async(segment.across, segment.source, stream)
            kind.record(segment.staged, stream)

    segments = plan.segments
    try:
        for segment in segments[:RING_SLOTS]:
            down(segment, None)
        for k, segment in enumerate(segments):
            kind.synchronize(segment.staged, deadline)
            segment.cross.run(max(0.0, deadline - time.monotonic()), tags + segment.tag)
            with lock:
                if segment.result is not None:
                    kind.copy_async(segment.result, segment.across, segment.stream)
                kind.record(segment.returned, segment.stream)
            if segment.spread is not None:
                on_devices(segment.spread, [segment.returned])
            if k + RING_SLOTS < len(segments):
                down(segments[k + RING_SLOTS], segment)  # into this slot, after its copy back
        with lock:  # every boundary stream's copies back, to the last
            for stream, event in plan.lanes:
                kind.record(event, stream)
        for _, event in plan.lanes:
            kind.synchronize(event, deadline)
        if queued:
            queued[-1].wait(deadline)  # fenced: the last group's end is every group's end
    except BaseException:
        # Nothing queued may touch the clients' memory once the error is answered.
        for group in queued:
            group.drain()
            group.recover()
        drain(kind, plan.lanes)
        raise
    finally:
        plan.release()
        devices.done(busy)
