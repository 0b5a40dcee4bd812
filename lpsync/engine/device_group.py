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

Two ways to run a plan: ``run`` (the clients' ready events polled from the host, enqueue,
host wait: the multi-node segments) and ``launch`` (stream-ordered completion, issue 47
item 1: on the job's own lanes the streams wait for the ready events and the job's
previous launch, "done" events are recorded for the clients' streams to wait on, and a
per-job watcher, ``Completions``, settles the launch off the answer).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, cast

from lpsync.algorithms.schedule import Kind, Schedule
from lpsync.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    ScheduleError,
    UnavailableError,
)
from lpsync.memory.kind import MemoryKind, Span, Topology
from lpsync.reduction import Reduction

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)
HOST_SLOTS = 2  # host staging buffers per link without peer access: double-buffered
DONE_EVENTS = 64  # interprocess "done" events per (session, device): one per outstanding collective
_PATIENCE = 3600.0  # how long a watcher waits for streams past a collective's deadline
log = logging.getLogger("lpsync.engine.device")
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
        self.done_events = DoneEvents(kind)
        self.completions = Completions()
        self.capture = True  # launches replay captured programs where the kind can capture
        # Per job (owner): the finals of its latest launch (the next one is fenced behind
        # them) and an error found after its collective was answered (the next one raises).
        self._last: dict[tuple, list[Any]] = {}
        self._failed: dict[tuple, LpsyncError] = {}

    def fence(self, owner: tuple, finals: list[Any] | None = None) -> list[Any]:
        """The finals of ``owner``'s previous launch; ``finals``: this launch's, kept for
        the next one."""
        with self._lock:
            previous = self._last.get(owner, [])
            if finals is not None:
                self._last[owner] = finals
            return previous

    def fail_later(self, owner: tuple, error: LpsyncError) -> None:
        """A collective of ``owner`` failed on the streams after it was answered: the
        job's next device collective raises it (the first one kept)."""
        with self._lock:
            self._failed.setdefault(owner, error)

    def take_failure(self, owner: tuple) -> LpsyncError | None:
        with self._lock:
            return self._failed.pop(owner, None)

    def forget(self, owner: tuple) -> None:
        """The job ended: its fence and pending failure go."""
        with self._lock:
            self._last.pop(owner, None)
            self._failed.pop(owner, None)

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
            if not any(k[0] == owner for k in self._lanes):  # the job's last plan closed
                self._last.pop(owner, None)
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
        self.completions.close()
        self.done_events.close()
        self.pool.close()


class DoneEvents:
    """The daemon's interprocess "done" events (kind.ipc_event), pooled per (session,
    device): one per outstanding stream-ordered collective of that session, given back
    once its record completed (then a client's later wait on it, which captures the
    latest record, waits for nothing it should not). At most DONE_EVENTS out per key:
    beyond, ``take`` says None and the collective is answered after a host wait. A
    session's events are destroyed when it ends (``drop``), those still out when they
    come back."""

    def __init__(self, kind: MemoryKind) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._free: dict[tuple[str, int], list[tuple[Any, bytes]]] = defaultdict(list)
        self._out: dict[tuple[str, int], int] = defaultdict(int)
        self._dropped: set[str] = set()
        self.made = 0  # events made (tests: reuse keeps this flat)

    def take(self, session: str, device: int) -> tuple[Any, bytes] | None:
        key = (session, device)
        with self._lock:
            if session in self._dropped:
                return None
            free = self._free.get(key)
            if free:
                self._out[key] += 1
                return free.pop()
            if self._out[key] >= DONE_EVENTS:
                return None
            self._out[key] += 1
            self.made += 1
        try:
            return self.kind.ipc_event(device)
        except BaseException:
            with self._lock:
                self._out[key] -= 1
            raise

    def give(self, session: str, device: int, entry: tuple[Any, bytes]) -> None:
        key = (session, device)
        with self._lock:
            self._out[key] -= 1
            if not self._out[key]:
                del self._out[key]
            if session not in self._dropped:
                self._free[key].append(entry)
                return
            if not any(k[0] == session for k in self._out):  # its last one came back
                self._dropped.discard(session)
        self.kind.destroy_event(entry[0])

    def outstanding(self) -> int:
        with self._lock:
            return sum(self._out.values())

    def pooled(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())

    def drop(self, session: str) -> None:
        """The session ended: its free events are destroyed now, the others on return."""
        with self._lock:
            keys = [k for k in self._free if k[0] == session]
            entries = [e for k in keys for e in self._free.pop(k)]
            if any(k[0] == session for k in self._out):
                self._dropped.add(session)
        for event, _ in entries:
            self.kind.destroy_event(event)

    def close(self) -> None:
        with self._lock:
            entries = [e for v in self._free.values() for e in v]
            self._free.clear()
        for event, _ in entries:
            with contextlib.suppress(Exception):
                self.kind.destroy_event(event)


class Completions:
    """One watcher thread per job (owner) that waits, on the host and off every answer,
    for the job's launches to finish on the streams, in launch order (a job's launches
    are fenced one behind the other), and runs each one's ``then``. Per job: a job whose
    streams wait for a dead client's event holds only its own watcher. A watcher idle
    for ``idle`` seconds ends (blocking on its queue meanwhile, never polling)."""

    def __init__(self, idle: float = 30.0) -> None:
        self.idle = idle
        self._lock = threading.Lock()
        self._queues: dict[tuple, queue.SimpleQueue] = {}
        self._closed = False

    def put(self, owner: tuple, work: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                start = None
                work_now = True
            else:
                work_now = False
                q = self._queues.get(owner)
                start = None
                if q is None:
                    q = self._queues[owner] = queue.SimpleQueue()
                    start = q
                q.put(work)
        if work_now:
            work()
            return
        if start is not None:
            threading.Thread(
                target=self._watch, args=(owner, start), name="lpsync-device-done", daemon=True
            ).start()

    def _watch(self, owner: tuple, q: queue.SimpleQueue) -> None:
        while True:
            try:
                work = q.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if q.empty():  # nothing arrived meanwhile: this watcher ends
                        self._queues.pop(owner, None)
                        return
                continue
            if work is None:
                return
            try:
                work()
            except Exception:
                log.exception("a device collective's completion failed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
            self._queues.clear()
        for q in queues:
            q.put(None)


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
    _inflight = 0  # launches not yet settled (a close gives memory back after the last)
    _closing = False
    _graph: Any = None  # the captured program (launch replays it), once captured
    _graph_done: Any = None  # recorded after each replay: the launch's one final
    _capture_failed = False

    def __init__(self) -> None:
        self._inflight_cond = threading.Condition()

    def close_after_launches(self) -> bool:
        """Mark the plan closing; True where no launch is in flight (give back now),
        else the last launch's settlement gives back."""
        with self._inflight_cond:
            self._closing = True
            return self._inflight == 0

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

    def stream_of(self, participant: int) -> Any:
        """A stream of this plan on ``participant``'s device (schedule order), where its
        "done" event is recorded; None where the plan has none there."""
        raise NotImplementedError

    def launch(
        self, owner: tuple, deadline: float, ready: Sequence[Any], done: Sequence[tuple[int, Any] | None]
    ) -> Launch:
        """Enqueue the plan without any host wait (stream-ordered completion, issue 47
        item 1): every stream first waits for the job's previous launch (its finals: no
        two launches of a job overlap, whatever streams they use) and for each client's
        ready event (cudaStreamWaitEvent: on the job's own lanes, so a client that never
        reaches its event holds only its job), then the operations; then, per participant
        with a ``done`` (participant, event), its stream waits for every final and records
        the event: the client's stream waits on that one. The returned Launch is settled
        by the context's watcher once the finals completed (or failed); ``then`` hooks run
        there. A failure to enqueue drains what went in and raises."""
        kind, context = self.kind, self.context
        with self._inflight_cond:
            self._inflight += 1
        try:
            with context.enqueue_lock:
                graph = self._captured()
                finals = self.finals if graph is None else [self._graph_done]
                launch = Launch(self, owner, deadline, finals)
                # Issued: every stream waits; replayed: the graph runs as one item of the
                # first stream, so that one waits (a graph's captured program cannot wait
                # on another process's event, nor on a record made outside it).
                streams = self.all_streams() if graph is None else self.all_streams()[:1]
                fence = context.fence(owner, finals)
                for stream in streams:
                    for event in fence:
                        kind.wait(stream, event)
                    for event in ready:
                        if event is not None:
                            kind.wait(stream, event)
                if graph is None:
                    for function, args in self.ops:
                        function(*args)
                else:
                    cast(Any, kind).launch_graph(graph, streams[0])
                    kind.record(self._graph_done, streams[0])
                for entry in done:
                    if entry is None:
                        continue
                    participant, event = entry
                    stream = self.stream_of(participant)
                    for final in finals:
                        kind.wait(stream, final)
                    kind.record(event, stream)
        except BaseException:
            self.drain()
            self.recover()
            self._settled()
            raise
        context.completions.put(owner, launch.watch)
        return launch

    def _captured(self) -> Any:
        """The plan's operations as one captured program (a CUDA graph), captured at the
        first launch (under the enqueue lock) and replayed by every later one; None
        where the kind has no capture, capturing is off, or the capture failed (then the
        operations are issued one by one, as before, and the log says why once). The
        first stream forks the others (a record they wait on) and each rejoins it at the
        end (a record it waits on), as CUDA's capture across streams requires."""
        if self._graph is not None or self._capture_failed:
            return self._graph
        kind = self.kind
        begin = getattr(kind, "begin_capture", None)
        if begin is None or not self.context.capture:
            self._capture_failed = True
            return None
        streams = self.all_streams()
        origin = streams[0]
        devices = [self._device_of(s) for s in streams]
        fork = kind.event(devices[0])
        joins = [kind.event(d) for d in devices[1:]]
        self._graph_done = kind.event(devices[0])
        begun = False
        try:
            begin(origin)
            begun = True
            kind.record(fork, origin)
            for stream in streams[1:]:
                kind.wait(stream, fork)
            for function, args in self.ops:
                function(*args)
            for stream, join in zip(streams[1:], joins, strict=True):
                kind.record(join, stream)
                kind.wait(origin, join)
            begun = False
            self._graph = cast(Any, kind).end_capture(origin)
            self._capture_events = [fork, *joins]
        except Exception as error:
            if begun:
                with contextlib.suppress(Exception):
                    cast(Any, kind).end_capture(origin)
            self._capture_failed = True
            log.warning(
                "a device plan could not be captured (%s); its operations are issued one by one", error
            )
            return None
        return self._graph

    @staticmethod
    def _device_of(stream: Any) -> int:
        """The device of a kind's stream (cuda: ``lpsync_device``; emulated: ``device``)."""
        device = getattr(stream, "lpsync_device", None)
        return int(stream.device if device is None else device)

    def _settled(self) -> None:
        """A launch finished on the streams (the watcher's, or a failed enqueue's)."""
        with self._inflight_cond:
            self._inflight -= 1
            closing = self._inflight == 0 and self._closing
            self._inflight_cond.notify_all()
        if closing:
            self._give_back()

    def _give_back(self) -> None:
        """Return what the plan holds (after its last launch finished)."""

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


class Launch:
    """One stream-ordered run of a plan: settled by the job's watcher (Completions) once
    its finals completed. ``then`` hooks run there, with the error (None: it finished);
    ``wait`` is the host wait, for callers that answer only after completion. An error
    found after the caller stopped waiting (``answered``) is kept for the job's next
    collective (DeviceContext.fail_later)."""

    def __init__(self, plan: StreamPlan, owner: tuple, deadline: float, finals: list[Any]) -> None:
        self.plan, self.owner, self.deadline, self.finals = plan, owner, deadline, finals
        self._cond = threading.Condition()
        self._done = False
        self._answered = False
        self.error: LpsyncError | None = None
        self._then: list[Callable[[LpsyncError | None], None]] = []

    def then(self, hook: Callable[[LpsyncError | None], None]) -> None:
        """Run ``hook(error)`` once settled (now, if it is)."""
        with self._cond:
            if not self._done:
                self._then.append(hook)
                return
        hook(self.error)

    def answered(self) -> None:
        """The caller answered already: a later error goes to the job's next collective."""
        with self._cond:
            self._answered = True
            if not self._done or self.error is None:
                return
        self.plan.context.fail_later(self.owner, self.error)

    def wait(self, deadline: float) -> None:
        """Until settled; its error raised. Past ``deadline``, CollectiveTimeoutError, but
        only once the streams finished (as ``run``: the error is answered after the last
        write into the clients' memory)."""
        late = False
        with self._cond:
            while not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = True
                    self._cond.wait_for(lambda: self._done, _PATIENCE)
                    break
                self._cond.wait(left)
            if late:
                raise CollectiveTimeoutError("the device streams did not finish the collective in time")
            if self.error is not None:
                raise self.error

    def watch(self) -> None:
        """On the job's watcher: until every final completed; a failure drains the streams
        first (a fresh record on each) and clears their errors where the kind can."""
        plan, error = self.plan, None
        try:
            # No deadline here: enqueued work cannot be taken back, and a stream-ordered
            # collective has been answered (a client that never reaches its ready event
            # holds its job's streams until its session ends and the event is closed).
            for event in self.finals:
                plan.kind.synchronize(event, self.deadline + _PATIENCE)
        except LpsyncError as failed:
            error = failed
        except Exception as failed:
            error = UnavailableError(f"a device operation failed: {failed!r}")
        if error is not None:
            plan.drain()
            plan.recover()
        with self._cond:
            self._done, self.error = True, error
            hooks, self._then = self._then, []
            answered = self._answered
            self._cond.notify_all()
        if error is not None and answered:
            plan.context.fail_later(self.owner, error)
        try:
            for hook in hooks:
                hook(error)
        finally:
            plan._settled()


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
        lanes: Lanes | None = None,
    ) -> None:
        """``lanes``: the job's own streams (a plan that ``launch``es: its streams wait on
        clients' events, so they must be the job's); else the context's shared ones. The
        group then owns them: ``close`` gives them back."""
        super().__init__()
        p = schedule.participants
        if len(buffers) != p:
            raise InvalidArgumentError(f"{len(buffers)} buffers for {p} participants")
        self.context, self.kind, self.schedule = context, context.kind, schedule
        self._lanes = lanes
        kind = self.kind
        devices = [inp.device for inp, _ in buffers]
        context.enable_peers(sorted(set(devices)))
        programs = [schedule.program(r) for r in range(p)]
        reduces = [any(step[0] == _RECV_REDUCE for step in prog) for prog in programs]
        slots: dict[int, int] = defaultdict(int)
        self.streams, self.copy_streams = [], []
        for d, pulls in zip(devices, reduces, strict=True):
            if lanes is None:
                self.streams.append(context.stream(d, slots[d]))
                self.copy_streams.append(context.stream(d, slots[d], "copy") if pulls else None)
            else:
                self.streams.append(lanes.get(d, f"main{slots[d]}"))
                self.copy_streams.append(lanes.get(d, f"copy{slots[d]}") if pulls else None)
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

    def stream_of(self, participant: int) -> Any:
        return self.streams[participant]

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
        """Give the staging buffers (and lanes) back; after the last launch in flight
        finished on the streams, never under it (``wait`` is LocalGroup's: the job's run
        lock means no ``run`` is in flight, but launches answer before they finish)."""
        if self.close_after_launches():
            self._give_back()

    def _give_back(self) -> None:
        held, self._held = self._held, []
        for memory in held:
            self.context.pool.give(memory)
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.close()

    def __enter__(self) -> DeviceGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
