"""Running a schedule over device buffers: the schedule compiled into stream operations.

The node's participants' buffers are device Spans (lpsync.memory.kind); every operation
goes through the memory kind's table, so the same plan drives the emulated device in CI
and cupy on a GPU. Plan once, run many: ``DeviceGroup`` turns every participant's
program into one list of (function, arguments) calls when it is built; ``run`` replays
the list and waits for the streams. Per message, with participant i on its own (main)
stream and, if it reduces, a copy stream:
  * SEND   i records ``ready`` on its stream (everything that wrote the span is before it);
           without peer access it first copies the span to a pinned host slot (two per
           link, alternating: double-buffered) and records after that copy;
  * RECV   j waits for ``ready`` and pulls the span (peer copy) into its buffer;
  * RECV_REDUCE  j's copy stream pulls the chunk into one of j's two staging buffers (from
           the pool, on j's device; double-buffered) and records ``consumed``; j's main
           stream waits for it and reduces there, so the next pull overlaps this reduction.
           When both share a device, j reduces straight from the sender's span;
  * a write over a span whose send is not yet consumed first waits for ``consumed``
    (the executor's rule: a sent span is not written until the send completed); a host
    slot is reused only after the previous message through it was consumed.
CUDA honours a wait only for records enqueued before it, so the list is ordered that
way: participants' programs are interleaved, a step going into the list only once the
records it waits on are in. Runs that share streams enqueue under one lock, so one run's
operations precede the next one's on every stream and no two runs can wait on each other.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from lpsync.algorithms.schedule import Kind, Schedule
from lpsync.errors import InvalidArgumentError, ScheduleError
from lpsync.memory.kind import MemoryKind, Span, Topology
from lpsync.reduction import Reduction

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)
HOST_SLOTS = 2  # host staging buffers per link without peer access: double-buffered
STAGING_SLOTS = 2  # device staging buffers per reducing participant: double-buffered


class StagingPool:
    """Device and host staging memory, reused across plans (allocations are slow on CUDA).
    What it keeps unused is bounded by count and by bytes (``keep_bytes``: 32 buffers of
    256 MiB would hold 8 GiB of a GPU); beyond, a buffer given back is freed (on the
    kind's Releaser, off the caller's thread)."""

    def __init__(self, kind: MemoryKind, keep: int = 32, keep_bytes: int = 512 << 20) -> None:
        self.kind, self.keep, self.keep_bytes = kind, keep, keep_bytes
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[Any]] = defaultdict(list)
        self.allocated = 0  # allocations made (tests: reuse keeps this flat)
        self.outstanding = 0
        self.kept_bytes = 0  # unused, held for reuse

    def take(self, device: int, nbytes: int, near: int = -1) -> Any:
        """Device memory on ``device``, or (``device`` < 0) pinned host memory allocated in
        ``near``'s context (never a device the daemon does not serve: kind.py)."""
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())  # power-of-two classes
        with self._lock:
            self.outstanding += 1
            free = self._free.get((device, size))
            if free:
                self.kept_bytes -= size
                return free.pop()
            self.allocated += 1
        try:
            return self.kind.allocate_host(size, near) if device < 0 else self.kind.allocate(device, size)
        except BaseException:
            with self._lock:
                self.outstanding -= 1
            raise

    def give(self, memory: Any) -> None:
        key = (memory.device, memory.nbytes)
        with self._lock:
            self.outstanding -= 1
            kept = sum(len(v) for v in self._free.values())
            if kept < self.keep and self.kept_bytes + memory.nbytes <= self.keep_bytes:
                self._free[key].append(memory)
                self.kept_bytes += memory.nbytes
                return
        self.kind.free(memory)

    def close(self) -> None:
        with self._lock:
            memories = [m for v in self._free.values() for m in v]
            self._free.clear()
            self.kept_bytes = 0
        for memory in memories:
            self.kind.free(memory)


class DeviceContext:
    """The daemon's per-kind state for collectives: streams per (device, slot), the
    staging pool and the enqueue lock. Slot: the n-th participant of a run on a device."""

    def __init__(self, kind: MemoryKind) -> None:
        self.kind = kind
        self.pool = StagingPool(kind)
        self.enqueue_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int, str], Any] = {}
        self._events: dict[tuple[int, int, str], Any] = {}
        self._lanes: dict[tuple[tuple, int, str], list[Any]] = {}  # (owner, device, role) -> [stream, users]
        # Peer access is enabled once per pair, not per plan; a pair refused for too many
        # peers (cudaErrorTooManyPeers) is then a HOST link in this topology.
        self.topology: Topology = kind.topology
        self._peers: set[tuple[int, int]] = set()

    def enable_peers(self, devices: Sequence[int]) -> None:
        """Enable peer access between ``devices`` where their link allows it, once."""
        with self._lock:
            for a in devices:
                for b in devices:
                    if a == b or (a, b) in self._peers or not self.topology.peer_access(a, b):
                        continue
                    self._peers.add((a, b))
                    if not self.kind.enable_peer_access(a, b):
                        self.topology = self.topology.without_peer_access(a, b)

    def stream(self, device: int, slot: int, role: str = "main") -> Any:
        """``role``: "main" runs a participant's program, "copy" its incoming pulls."""
        key = (device, slot, role)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = self.kind.stream(device)
            return stream

    def lane(self, owner: tuple, device: int, role: str) -> Any:
        """A stream of ``owner``'s own (a job's) on ``device``: what it queues there never
        waits behind another job's work, so a slow job, or one whose peer died mid-segment,
        delays only itself. Counted per user (a plan); ``drop_lane`` ends it with the last."""
        key = (owner, device, role)
        with self._lock:
            entry = self._lanes.get(key)
            if entry is None:
                entry = self._lanes[key] = [self.kind.stream(device), 0]
            entry[1] += 1
            return entry[0]

    def drop_lane(self, owner: tuple, device: int, role: str) -> None:
        """One user of the lane is done with it (its runs drained); the last one ends it,
        off the caller's thread (a plan closes on the event loop; ending a stream waits
        for what is queued on it)."""
        key = (owner, device, role)
        with self._lock:
            entry = self._lanes.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._lanes[key]
        self._end_stream(entry[0])

    def _end_stream(self, stream: Any) -> None:
        releaser = getattr(self.kind, "releaser", None)
        if releaser is None:
            self.kind.destroy_stream(stream)
        else:
            releaser.put(-1, lambda: self.kind.destroy_stream(stream))

    def event(self, device: int, slot: int, role: str) -> Any:
        """An event of the stream (device, slot, role), made once and recorded again by
        each run that uses that stream (a wait sees its latest record: a later run's record
        on the same stream covers this run's work too). Kept: on CUDA an event destroyed by
        the garbage collector in a thread with no device set could make a context on GPU 0."""
        key = (device, slot, role)
        with self._lock:
            event = self._events.get(key)
            if event is None:
                event = self._events[key] = self.kind.event(device)
            return event

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values()) + [stream for stream, _ in self._lanes.values()]
            self._streams.clear()
            self._events.clear()
            self._lanes.clear()
        for stream in streams:
            self.kind.destroy_stream(stream)
        self.pool.close()


class Lanes:
    """The streams a plan of one job takes on the daemon's devices (DeviceContext.lane):
    its own, so what it queues never waits behind another job's work; given back when the
    plan closes."""

    def __init__(self, context: DeviceContext, owner: tuple) -> None:
        self.context, self.owner = context, owner
        self._taken: dict[tuple[int, str], Any] = {}

    def get(self, device: int, role: str) -> Any:
        stream = self._taken.get((device, role))
        if stream is None:
            stream = self._taken[device, role] = self.context.lane(self.owner, device, role)
        return stream

    def close(self) -> None:
        taken, self._taken = self._taken, {}
        for device, role in taken:
            self.context.drop_lane(self.owner, device, role)


class Scratch:
    """Staging memory shared by groups that never run at once: a hierarchical collective's
    segments (lpsync.daemon.collectives.hierarchy) run one after another on the same
    streams, each fenced behind the last, so one set serves them all instead of one per
    segment. Taken from the pool, given back by ``close``."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self._by_key: dict[tuple, Any] = {}
        self._taken: list[Any] = []

    def take(self, key: tuple, device: int, nbytes: int, near: int = -1) -> Any:
        key = (*key, device, near)
        memory = self._by_key.get(key)
        if memory is None or memory.nbytes < nbytes:
            memory = self.pool.take(device, nbytes, near)
            self._taken.append(memory)  # an earlier group may still name the smaller one
            self._by_key[key] = memory
        return memory

    def close(self) -> None:
        taken, self._taken = self._taken, []
        self._by_key.clear()
        for memory in taken:
            self.pool.give(memory)


class StreamPlan:
    """A plan compiled into stream operations: ``ops`` (function, arguments) replayed by
    each run under the context's enqueue lock, and ``finals``, one event per stream of
    ``all_streams`` recorded last. How every device plan runs (DeviceGroup's schedules,
    lpsync.engine.oneshot's kernels): the clients' ready events first, then the
    operations, then the host waits for the streams; a failed run drains them first."""

    context: DeviceContext
    kind: MemoryKind
    ops: list[tuple[Callable[..., None], tuple]]
    finals: list[Any]

    def all_streams(self) -> list[Any]:
        raise NotImplementedError

    def run(self, deadline: float, ready: Sequence[Any] = ()) -> None:
        """Replay the plan; returns once every participant's stream has finished it.
        ``ready``: per participant (schedule order) the client's interprocess event (its
        own stream's work on the buffers), or None. They are polled from this thread before
        anything is enqueued, never waited on by the streams: those are shared by every job,
        and a client that dies with its event pending must cost only its own collective.
        A failed run returns (raises) only once its streams drained: the caller answers
        the error then, and the client may free its memory."""
        kind = self.kind
        try:
            for event in ready:
                if event is not None:
                    kind.wait_ready(event, deadline)
            self.enqueue()
            self.wait(deadline)
        except BaseException:
            self.drain()
            self.recover()
            raise

    def enqueue(self, after: Sequence[Any] = ()) -> None:
        """Queue the plan on the streams without waiting for it; every stream first waits
        for the events ``after`` (recorded before: CUDA honours only those)."""
        kind = self.kind
        with self.context.enqueue_lock:
            for stream in self.all_streams():
                for event in after:
                    kind.wait(stream, event)
            for function, args in self.ops:
                function(*args)

    def wait(self, deadline: float) -> None:
        """Until every stream finished what ``enqueue`` queued."""
        for event in self.finals:
            self.kind.synchronize(event, deadline)

    def drain(self, patience: float = 3600.0) -> None:
        """Wait for the streams to finish what a failed run left queued (errors ignored):
        a fresh record on every stream, so that a run stopped half-way is covered too."""
        with self.context.enqueue_lock, contextlib.suppress(Exception):
            for event, stream in zip(self.finals, self.all_streams(), strict=True):
                self.kind.record(event, stream)
        for event in self.finals:
            with contextlib.suppress(Exception):  # the run already reported its failure
                self.kind.synchronize(event, time.monotonic() + patience)

    def recover(self) -> None:
        """After ``drain``: clear the streams' errors where the kind can (emulated)."""
        recover = getattr(self.kind, "recover", None)
        if recover is not None:
            for stream in self.all_streams():
                recover(stream)


class DeviceGroup(StreamPlan):
    """Participants 0..P-1 of ``schedule`` (in schedule order) over (IN, OUT) device spans.
    ``scratch``: staging memory shared with other groups that are never in flight at the
    same time (the caller fences them: ``enqueue(after=...)``); else the group's own."""

    def __init__(
        self,
        context: DeviceContext,
        schedule: Schedule,
        buffers: Sequence[tuple[Span, Span]],
        reduction: Reduction | None,
        scratch: Scratch | None = None,
    ) -> None:
        p = schedule.participants
        if len(buffers) != p:
            raise InvalidArgumentError(f"{len(buffers)} buffers for {p} participants")
        self.context, self.kind, self.schedule = context, context.kind, schedule
        kind = self.kind
        devices = [inp.device for inp, _ in buffers]
        context.enable_peers(sorted(set(devices)))
        programs = [schedule.program(r) for r in range(p)]
        reduces = [any(step[0] == _RECV_REDUCE for step in prog) for prog in programs]
        slots: dict[int, int] = defaultdict(int)
        self.streams, self.copy_streams = [], []
        for d, pulls in zip(devices, reduces, strict=True):
            self.streams.append(context.stream(d, slots[d]))
            self.copy_streams.append(context.stream(d, slots[d], "copy") if pulls else None)
            slots[d] += 1
        self._held: list[Any] = []  # pool memory, returned on close
        self._scratch = scratch
        dtype = buffers[0][0].dtype
        tmps: list[Span | None] = []
        for r, d in enumerate(devices):
            if schedule.tmp_elements:
                memory = self._take(d, schedule.tmp_elements * dtype.itemsize, share=("tmp", r))
                tmps.append(Span(memory, 0, schedule.tmp_elements, dtype))
            else:
                tmps.append(None)
        bufs = [(inp, out, tmp) for (inp, out), tmp in zip(buffers, tmps, strict=True)]
        chunk = (
            max(
                (hi - lo for prog in programs for k, _, _, lo, hi, *_ in prog if k in (_SEND, _RECV_REDUCE)),
                default=0,
            )
            * dtype.itemsize
        )
        # Two staging buffers per reducing participant: the next chunk lands in one while
        # the reduction reads the other.
        staging = [
            [self._take(d, chunk, share=("pull", r, i)) for i in range(STAGING_SLOTS)] if pulls else None
            for r, (d, pulls) in enumerate(zip(devices, reduces, strict=True))
        ]
        host_slots: dict[tuple[int, int], list[Any]] = {}
        self.ops: list[tuple[Callable[..., None], tuple]] = []
        self._compile(programs, bufs, devices, staging, host_slots, chunk, reduction)
        self.finals = []
        for stream, device in self._streams_with_devices(devices):
            event = kind.event(device)
            self.ops.append((kind.record, (event, stream)))
            self.finals.append(event)

    def all_streams(self) -> list[Any]:
        return self.streams + [s for s in self.copy_streams if s is not None]

    def _streams_with_devices(self, devices: list[int]) -> list[tuple[Any, int]]:
        pairs = list(zip(self.streams, devices, strict=True))
        return pairs + [(s, d) for s, d in zip(self.copy_streams, devices, strict=True) if s is not None]

    def _take(self, device: int, nbytes: int, near: int = -1, share: tuple = ()) -> Any:
        if self._scratch is not None:
            return self._scratch.take(share, device, nbytes, near)
        memory = self.context.pool.take(device, nbytes, near)
        self._held.append(memory)
        return memory

    def _compile(self, programs, bufs, devices, staging, host_slots, chunk, reduction) -> None:
        kind, streams, ops, topo = self.kind, self.streams, self.ops, self.context.topology
        p = len(programs)
        ready: dict[tuple[int, int, int], tuple[Any, Span]] = {}  # (src, dst, tag) -> event, data
        consumed: dict[tuple[int, int, int], Any] = {}
        unconsumed: list[list[tuple[int, int, tuple]]] = [[] for _ in range(p)]  # sends to guard
        slot_users: dict[tuple[int, int], list[tuple | None]] = {}
        sent_on_link: dict[tuple[int, int], int] = defaultdict(int)
        pc = [0] * p

        def direct(a: int, b: int) -> bool:
            return devices[a] == devices[b] or topo.peer_access(devices[a], devices[b])

        def guard_ready(r: int, span: Span) -> bool:
            return all(key in consumed for lo, hi, key in unconsumed[r] if lo < span.hi and span.lo < hi)

        def guard(r: int, span: Span) -> None:
            still = []
            for lo, hi, key in unconsumed[r]:
                if lo < span.hi and span.lo < hi:
                    ops.append((kind.wait, (streams[r], consumed[key])))
                else:
                    still.append((lo, hi, key))
            unconsumed[r] = still

        pulls = [0] * p
        slot_free: list[list[Any]] = [[None] * STAGING_SLOTS for _ in range(p)]

        def pull(r: int, key: tuple, acc: Span, dst: Span, data: Span, final: bool) -> None:
            """The chunk comes over on r's copy stream into a staging slot, the reduction
            runs on r's main stream: the next pull overlaps this reduction."""
            slot = pulls[r] % STAGING_SLOTS
            pulls[r] += 1
            copier, event = self.copy_streams[r], ready[key][0]
            incoming = Span(staging[r][slot], 0, dst.count, dst.dtype)
            ops.append((kind.wait, (copier, event)))
            if slot_free[r][slot] is not None:  # the reduction that read it last is done
                ops.append((kind.wait, (copier, slot_free[r][slot])))
            ops.append((kind.copy_async, (incoming, data, copier)))
            landed = kind.event(devices[r])  # also: the sender's span was read (consumed)
            ops.append((kind.record, (landed, copier)))
            consumed[key] = landed
            ops.append((kind.wait, (streams[r], landed)))
            ops.append((kind.reduce_async, (reduction, dst, acc, incoming, final, streams[r])))
            free = kind.event(devices[r])
            ops.append((kind.record, (free, streams[r])))
            slot_free[r][slot] = free

        def step(r: int) -> bool:
            kind_, peer, buf, lo, hi, src, src_lo, final, tag = programs[r][pc[r]]
            dst = bufs[r][buf][lo:hi]
            stream = streams[r]
            if kind_ == _SEND:
                key = (r, peer, tag)
                event = kind.event(devices[r])
                if direct(r, peer):
                    ops.append((kind.record, (event, stream)))
                    ready[key] = (event, dst)
                    unconsumed[r].append((dst.lo, dst.hi, key))
                    return True
                link = (r, peer)
                n = sent_on_link[link]
                users = slot_users.setdefault(link, [None] * HOST_SLOTS)
                previous = users[n % HOST_SLOTS]
                if previous is not None and previous not in consumed:
                    return False
                if link not in host_slots:
                    host_slots[link] = [
                        self._take(-1, chunk, devices[r], share=("host", *link, i)) for i in range(HOST_SLOTS)
                    ]
                slot = Span(host_slots[link][n % HOST_SLOTS], 0, dst.count, dst.dtype)
                if previous is not None:
                    ops.append((kind.wait, (stream, consumed[previous])))
                ops.append((kind.copy_async, (slot, dst, stream)))
                ops.append((kind.record, (event, stream)))
                ready[key] = (event, slot)
                users[n % HOST_SLOTS] = key
                sent_on_link[link] = n + 1
                return True
            if kind_ in (_RECV, _RECV_REDUCE):
                key = (peer, r, tag)
                if key not in ready or not guard_ready(r, dst):
                    return False
                guard(r, dst)
                event, data = ready[key]
                if kind_ == _RECV_REDUCE and data.device != devices[r]:
                    acc = bufs[r][src][src_lo : src_lo + hi - lo]
                    pull(r, key, acc, dst, data, bool(final))
                    return True
                ops.append((kind.wait, (stream, event)))
                if kind_ == _RECV:
                    ops.append((kind.copy_async, (dst, data, stream)))
                else:  # the sender shares this device: reduce straight from its span
                    acc = bufs[r][src][src_lo : src_lo + hi - lo]
                    ops.append((kind.reduce_async, (reduction, dst, acc, data, bool(final), stream)))
                done = kind.event(devices[r])
                ops.append((kind.record, (done, stream)))
                consumed[key] = done
                return True
            source = bufs[r][src][src_lo : src_lo + hi - lo]  # COPY
            if source.lo == dst.lo:
                return True  # in place: already there
            if not guard_ready(r, dst):
                return False
            guard(r, dst)
            ops.append((kind.copy_async, (dst, source, stream)))
            return True

        left = sum(len(prog) for prog in programs)
        while left:
            progressed = False
            for r in range(p):
                while pc[r] < len(programs[r]) and step(r):
                    pc[r] += 1
                    left -= 1
                    progressed = True
            if not progressed:
                raise ScheduleError(
                    f"{self.schedule.algorithm} {self.schedule.op}: the schedule "
                    "cannot be ordered onto streams (a send is never matched)"
                )

    def close(self, wait: bool = True) -> None:
        """Give the staging buffers back to the pool. Nothing to wait for (``wait`` is
        LocalGroup's): the job's run lock means no run of this group is in flight."""
        held, self._held = self._held, []
        for memory in held:
            self.context.pool.give(memory)

    def __enter__(self) -> DeviceGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
