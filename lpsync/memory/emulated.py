"""The emulated device (``--devices emulated:N``): the CUDA contract of kind.py on the host.

What stands in for what:
  * device memory: a memfd (anonymous shared memory, never a /dev/shm name that a killed
    process could leak) mapped into this process;
  * an IPC handle: the exporter's (pid, fd, inode, size, device), packed as
    lpsync_client.emulated packs it. Opening maps /proc/<pid>/fd/<fd> after checking the
    inode, so, like cudaIpcOpenMemHandle, it works only while the exporter is alive, and
    the memory stays valid until the opener closes it, whatever the exporter does;
  * a stream: one worker thread that runs queued operations in order (blocking on its
    queue, never polling); an operation that fails poisons the stream: later ones are
    skipped and the error is raised by every synchronize (CUDA's sticky errors) until
    ``recover`` (the engine calls it once the failed run has drained);
  * an event: a record counter; ``wait`` captures the latest record at call time, so a
    wait enqueued before its record is a no-op exactly as cudaStreamWaitEvent's;
  * copies and reductions: numpy on the mapped bytes (lpsync.reduction), GIL
    released, so streams of different devices overlap.
  * a context: ``contexts[d]`` counts the contexts made on device d (one, at the first
    operation that needs one there, as CUDA's primary context); an operation that names
    no device (``allocate_host`` without one) runs on device 0, as a CUDA runtime call
    does in a thread where no device was made current, so a daemon serving only other
    devices that touches device 0 shows it (~300-500 MB of GPU memory on CUDA);
  * ``write`` with ``copy_bandwidth`` set is a pageable cudaMemcpy host-to-device: it
    returns once the bytes are staged and lands them after the link's time on the
    device's legacy stream (``read`` is ordered after it, the kind's streams are not),
    so a daemon that answers on its strength answers before the result is there;
  * a client freeing an allocation this process still maps (cudaFree before
    cudaIpcCloseMemHandle: undefined behaviour on CUDA) is detected: every mapping holds
    a shared lock on the allocation's memfd that the client's ``free`` tests
    (lpsync_client.emulated), and a mapping whose allocation was freed fails the next
    operation that touches it (``check_mapped``) instead of reading freed memory.
  * as strict as CUDA where CUDA is unforgiving (docs/gpu.md, second reading):
    querying, recording or waiting on a destroyed event is an error (a use after free of
    the handle on CUDA); a device whose context took a sticky error (``fail_device``,
    CUDA's cudaErrorLaunchFailure and kin) fails every wait and synchronize, never reads
    as "not ready"; a thread the kind does not own has no current device until
    ``bind_thread`` (cudaSetDevice), and posting a device span to the wire from such a
    thread is an error (UCX's cuda transports segfault there, nixl#2102); freeing or
    unmapping memory while a transfer is posted on it is recorded in ``faults`` and the
    memory is kept until the transfer let go (CUDA: UCX would write into freed memory);
    posting memory opened through IPC (a client's allocation) is refused: UCX's
    registration cache is not told of cudaIpcCloseMemHandle, and a later mapping at the
    same address would be sent through a stale registration;
  * frees and event destruction run on the kind's Releaser (kind.py), never on the
    caller's thread (the event loop's), with the device current.
``opens``/``closes`` count IPC opens and closes per device for tests and status.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from lpsync.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    NotFoundError,
    UnavailableError,
)
from lpsync.memory.kind import Releaser, Span, Topology, oneshot_refusal
from lpsync.reduction import Reduction
from lpsync_client import futex
from lpsync_client.wire import EMULATED_EVENT_HANDLE as EVENT_HANDLE
from lpsync_client.wire import EMULATED_EVENT_MAGIC as EVENT_MAGIC
from lpsync_client.wire import EMULATED_HANDLE as HANDLE
from lpsync_client.wire import EMULATED_MAGIC as MAGIC
from lpsync_client.wire import emulated_uuid

# The handles' layouts are the client's (lpsync_client.wire): it packs them, we unpack.
_MEMFD_PREFIX = "/memfd:lpsync-"  # memfd_create names: lpsync-emu<d>, lpsync-client-emu<d>
_EVENT_PREFIX = "/memfd:lpsync-event"
_EVENT_BYTES = 8
_current = threading.local()  # per thread: the device made current (cudaSetDevice's stand-in)


def current_device() -> int | None:
    """The device current in the calling thread, None where none was made current."""
    return getattr(_current, "device", None)


@dataclass(eq=False)
class EmulatedMemory:
    device: int
    nbytes: int
    array: np.ndarray  # the bytes, uint8
    address: int
    _mmap: mmap.mmap | None
    fd: int = -1  # kept open by allocations we made (so that they can be exported)
    inode: int = 0
    opened: bool = False
    closed: bool = False  # an IPC mapping closed: using it is a fault on CUDA
    # An IPC mapping: the exporter's (pid, fd) and a descriptor of the allocation holding
    # a shared flock for as long as it is mapped (the client's free() tests for it).
    origin: tuple[int, int] | None = None
    lock_fd: int = -1
    posted: int = 0  # transfers posted on it (wire views handed to UCX) not yet ended
    freed: bool = False  # freed or closed: a transfer posted on it now is a fault

    def release(self) -> None:
        mapping, self._mmap = self._mmap, None
        self.array = np.empty(0, np.uint8)
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still held: GC unmaps it later
                mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # drops the shared lock: the exporter may free it now
            self.lock_fd = -1


def _map(fd: int, nbytes: int) -> tuple[np.ndarray, mmap.mmap | None]:
    if not nbytes:
        return np.empty(0, np.uint8), None
    mapping = mmap.mmap(fd, nbytes)
    return np.frombuffer(mapping, np.uint8, nbytes), mapping


def _open_foreign(pid: int, fd: int, prefix: str, names: str, thing: str, hint: str) -> int:
    """Open file descriptor ``fd`` of process ``pid`` (what an IPC handle names) read-write,
    only if it is one of ours (its name starts with ``prefix``): a handle must never make
    the daemon map, and write, an arbitrary file another process has open."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(prefix):
            raise InvalidArgumentError(f"the handle does not name {names}")
        return os.open(path, os.O_RDWR)
    except OSError as error:
        raise NotFoundError(f"cannot open the {thing} of process {pid}: {error} ({hint})") from None


def _view(span: Span) -> np.ndarray:
    return span.memory.array[span.offset : span.offset + span.nbytes]


class WireView(np.ndarray):
    """Device bytes as ``wire`` hands them to a transport: UCX posts them from its progress
    thread, which must have made a device current first (``lpsync_bind``), and counts the
    transfer on the memory while it is posted (``lpsync_post``): what UCX's cuda
    transports need, and what a free must not overtake."""

    lpsync_kind: EmulatedKind | None = None
    lpsync_memory: EmulatedMemory | None = None

    def __array_finalize__(self, obj: object) -> None:
        self.lpsync_kind = getattr(obj, "lpsync_kind", None)
        self.lpsync_memory = getattr(obj, "lpsync_memory", None)

    def lpsync_bind(self) -> None:
        if self.lpsync_kind is not None and self.lpsync_memory is not None:
            self.lpsync_kind.bind_thread(self.lpsync_memory.device)

    def lpsync_post(self) -> Callable[[], None]:
        """Count a transfer posted on these bytes; returns its end (call once)."""
        kind, memory = self.lpsync_kind, self.lpsync_memory
        if kind is None or memory is None:
            return lambda: None
        return kind.post(memory)


class EmulatedEvent:
    def __init__(self, device: int, on_drop: Callable[[int], None] | None = None) -> None:
        self.device = device  # as a CUDA event, it belongs to one device
        self.destroyed = False  # destroy_event: any later use is an error
        self._on_drop = on_drop  # dropped undestroyed: destroyed on the kind's Releaser
        self._cond = threading.Condition()
        self.recorded = 0  # records enqueued
        self.completed = 0  # records whose stream reached them
        self.error: BaseException | None = None
        # Recorded into a capture still open: (capture, record node). Such a record is
        # no record at all outside the capture (CUDA: a captured cudaEventRecord).
        self.captured: tuple[EmulatedCapture, int] | None = None

    def _complete(self, generation: int, error: BaseException | None) -> None:
        with self._cond:
            self.completed = max(self.completed, generation)
            self.error = error  # the state of the latest record
            self._cond.notify_all()

    def __del__(self) -> None:
        if self._on_drop is not None and not self.destroyed:
            self._on_drop(self.device)

    def wait_for(self, generation: int, deadline: float | None) -> None:
        with self._cond:
            while self.completed < generation:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CollectiveTimeoutError("a device stream did not finish in time")
                self._cond.wait(left)


class EmulatedExportedEvent(EmulatedEvent):
    """An own event another process may open (cudaEventInterprocess, then
    cudaIpcGetEventHandle): the daemon's "done" event of a stream-ordered collective. Its
    records are mirrored into an 8-byte memfd laid out as a client's event (u32 records
    made, u32 records completed); a completion stores the number and wakes the futex, so
    a client stream waiting on it (lpsync_client.emulated.OpenedEvent) sleeps until then."""

    def __init__(self, device: int, on_drop: Callable[[int], None] | None = None) -> None:
        super().__init__(device, on_drop)
        self._fd = os.memfd_create("lpsync-event-daemon", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _EVENT_BYTES)
        self._mapping = mmap.mmap(self._fd, _EVENT_BYTES)
        self._words = np.frombuffer(self._mapping, np.uint32, 2)
        self.handle = EVENT_HANDLE.pack(EVENT_MAGIC, os.getpid(), self._fd, os.fstat(self._fd).st_ino)

    def note_record(self, generation: int) -> None:
        self._words[0] = generation & 0xFFFFFFFF

    def _complete(self, generation: int, error: BaseException | None) -> None:
        super()._complete(generation, error)
        self._words[1] = generation & 0xFFFFFFFF
        futex.wake(self._words.__array_interface__["data"][0] + 4)

    def release(self) -> None:
        """The memfd goes (on destroy): a client that opened it keeps its own mapping."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EmulatedIpcEvent:
    """An event another process exports (cudaIpcOpenEventHandle's stand-in): its shared
    record of (records enqueued, records completed); waits sleep on the completed word."""

    def __init__(self, words: np.ndarray, mapping: mmap.mmap, device: int = 0) -> None:
        self._words, self._mapping = words, mapping  # the mapping lives as long as this
        self.device = device
        self.address = words.__array_interface__["data"][0]
        self.closed = False

    def recorded(self) -> int:
        return int(self._words[0])

    def reached(self, generation: int) -> bool:
        return (int(self._words[1]) - generation) & 0xFFFFFFFF < 0x80000000

    def wait_for(self, generation: int, timeout: float) -> None:
        """Until ``generation`` completed, or at most ``timeout`` s (callers re-check)."""
        completed = int(self._words[1])
        if (completed - generation) & 0xFFFFFFFF >= 0x80000000:
            futex.wait(self.address + 4, completed, timeout)

    def close(self) -> None:
        self.closed = True
        futex.wake(self.address + 4)  # a stream waiting on it notices and gives up


_STOP = object()
_Node = tuple[str, object]  # ("op", callable) | ("record", node id) | ("wait", node id)


class EmulatedCapture:
    """A stream capture in progress (cudaStreamBeginCapture on ``origin``): what the
    capturing streams are given is recorded per stream (a lane of nodes), not run. A
    stream joins by waiting on an event recorded in the capture (CUDA's fork); waiting on
    anything recorded outside it (another process's event, an earlier eager record)
    invalidates the capture, as do host waits on its events; every other stream must
    have rejoined the origin (its last node a record the origin waited on) when it ends
    (cudaErrorStreamCaptureUnjoined)."""

    def __init__(self, origin: EmulatedStream) -> None:
        self.origin = origin
        self.lanes: dict[EmulatedStream, list[_Node]] = {origin: []}
        self.records = 0
        self.events: list[EmulatedEvent] = []
        self.invalid: str | None = None
        self.open = True

    def record(self, stream: EmulatedStream, event: EmulatedEvent) -> None:
        node = self.records
        self.records += 1
        self.lanes[stream].append(("record", node))
        event.captured = (self, node)
        self.events.append(event)

    def invalidate(self, why: str) -> UnavailableError:
        self.invalid = self.invalid or why
        return UnavailableError(f"stream capture invalidated: {why}")


@dataclass(eq=False)
class EmulatedGraph:
    """A captured program (cudaGraphExec_t): per captured stream its nodes; launched as
    one item of a stream, its lanes run concurrently, ordered only by the captured
    record -> wait edges."""

    lanes: list[list[_Node]]
    records: int

    def run(self, stream: EmulatedStream) -> None:
        if len(self.lanes) == 1:
            for what, item in self.lanes[0]:
                if what == "op":
                    cast("Callable[[], None]", item)()
            return
        reached = [threading.Event() for _ in range(self.records)]
        errors: list[BaseException] = []

        def lane(nodes: list[_Node]) -> None:
            for what, item in nodes:
                if errors:
                    return
                if what == "record":
                    reached[cast(int, item)].set()
                elif what == "wait":
                    while not reached[cast(int, item)].wait(1.0):
                        if stream.closed.is_set():
                            errors.append(UnavailableError("the stream ended under a graph launch"))
                            return
                else:
                    try:
                        cast("Callable[[], None]", item)()
                    except BaseException as error:
                        errors.append(error)
                        for flag in reached:  # the other lanes stop at their next node
                            flag.set()
                        return

        helpers = [
            threading.Thread(target=lane, args=(nodes,), name="lpsync-emu-graph", daemon=True)
            for nodes in self.lanes[1:]
        ]
        for helper in helpers:
            helper.start()
        lane(self.lanes[0])
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]


@dataclass(eq=False)
class EmulatedStream:
    device: int
    _queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    error: BaseException | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    capture: EmulatedCapture | None = None  # capturing: what it is given is recorded

    def __post_init__(self) -> None:
        self._thread = threading.Thread(
            target=self._work, name=f"lpsync-emu-stream-{self.device}", daemon=True
        )
        self._thread.start()

    def put(
        self, op: Callable[[], None] | Callable[[BaseException | None], None], wants_error: bool = False
    ) -> None:
        if self.capture is not None:
            self.capture.lanes[self].append(("op", op))
            return
        self._queue.put((op, wants_error))

    def _work(self) -> None:
        _current.device = self.device  # a stream's work runs in its device's context
        while True:
            item = self._queue.get()  # blocks: no polling
            if item is _STOP:
                return
            op, wants_error = item
            if wants_error:  # event records run even on a poisoned stream, carrying its error
                op(self.error)
                continue
            if self.error is not None:
                continue
            try:
                op()
            except BaseException as error:
                self.error = error

    def stop(self) -> None:
        self.closed.set()
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class EmulatedKind:
    name = "emulated"

    def __init__(
        self,
        devices: int,
        topology: Topology | None = None,
        copy_bandwidth: float = 0.0,
        max_peers: int = 8,
    ) -> None:
        """``copy_bandwidth`` (bytes/s, 0: as fast as memcpy) slows every copy down to a
        link's rate, for tests that need copies to take time. ``max_peers``: peers one
        device may enable (CUDA: 8 over PCIe); past it cudaErrorTooManyPeers, and a copy
        over a refused pair fails."""
        if devices < 1:
            raise InvalidArgumentError("an emulated device set needs at least one device")
        self.devices = devices
        self.topology = topology or Topology.uniform(devices)
        if len(self.topology.links) != devices:
            raise InvalidArgumentError("the topology does not match the device count")
        self.copy_bandwidth = copy_bandwidth
        self._lock = threading.Lock()
        self.opens = [0] * devices
        self.closes = [0] * devices
        self._streams: set[EmulatedStream] = set()
        self.peer_enabled: set[tuple[int, int]] = set()
        self.peer_refused: set[tuple[int, int]] = set()
        self.peer_enables = 0  # calls, for tests: once per pair, not per plan
        self.max_peers = max_peers
        self.contexts = [0] * devices  # contexts made per device (one at most, as CUDA's primary)
        self._legacy: dict[int, EmulatedStream] = {}  # per device: where pageable writes land
        self.releaser = Releaser("lpsync-emu-release", self.bind_thread)
        self.faults: list[str] = []  # what CUDA would have done wrong, silently (tests read it)
        self._sticky: dict[int, BaseException] = {}  # per device: a sticky error (fail_device)
        self.destroyed_events = 0  # on the Releaser, with the device current
        self.captures = self.graph_launches = 0  # programs captured, launches of them

    def _context(self, device: int) -> None:
        """An operation needs ``device``'s context: made at the first (CUDA: ~300-500 MB)."""
        if device >= 0 and not self.contexts[device]:
            with self._lock:
                self.contexts[device] = 1

    def _fault(self, what: str) -> None:
        with self._lock:
            self.faults.append(what)

    def bind_thread(self, device: int) -> None:
        self._check(device)
        self._context(device)
        _current.device = device

    def fail_device(self, device: int, error: str = "cudaErrorLaunchFailure") -> None:
        """A sticky error in ``device``'s context (a kernel fault on CUDA): every later
        query, wait and synchronize of its events fails with it; nothing clears it."""
        with self._lock:
            self._sticky[device] = UnavailableError(
                f"device {device}: {error} (a sticky error: the context is lost)"
            )

    def _status(self, device: int) -> None:
        """Raise the device's sticky error, if it has one (what cudaEventQuery returns)."""
        error = self._sticky.get(device)
        if error is not None:
            raise type(error)(*error.args)

    def post(self, memory: EmulatedMemory) -> Callable[[], None]:
        """A transfer posted on ``memory`` from the calling thread (WireView.lpsync_post):
        an error unless a device is current here; returns the transfer's end."""
        if current_device() is None:
            raise UnavailableError(
                f"thread {threading.current_thread().name} touches device {memory.device}'s memory "
                "with no device current (UCX's cuda transports segfault there: nixl#2102)"
            )
        if memory.freed:
            self._fault(f"a transfer posted on freed memory of device {memory.device}")
            raise UnavailableError("a transfer posted on freed device memory")
        if memory.origin is not None:  # opened through IPC: a client's allocation
            raise UnavailableError(
                f"a transfer posted on device {memory.device}'s memory opened through IPC (a client's "
                "allocation): UCX is handed only the daemon's own device memory, its registration "
                "cache is not told when an IPC mapping closes"
            )
        with self._lock:
            memory.posted += 1
        ended = False

        def end() -> None:
            nonlocal ended
            with self._lock:
                if ended:
                    return
                ended = True
                memory.posted -= 1
                release = memory.freed and memory.posted == 0
            if release:  # freed while posted (a fault, recorded): let go of it now
                self.releaser.put(-1, memory.release)

        return end

    def _let_go(self, memory: EmulatedMemory, what: str, later: bool) -> None:
        """Free (``later``: on the Releaser) or unmap (now: the registry answers once the
        client may free) ``memory``; a transfer still posted on it is a fault (CUDA: UCX
        writes into freed memory), and the bytes are kept until it ends."""
        with self._lock:
            memory.freed = True
            posted = memory.posted
        if posted:
            self._fault(
                f"{what} of device {memory.device}'s memory while {posted} transfer(s) were posted on it"
            )
            return
        if not later:
            memory.release()
            return
        device = memory.device

        def release() -> None:
            if device >= 0 and current_device() is None:
                self._context(0)  # CUDA: the free makes device 0's context current
            memory.release()

        self.releaser.put(device, release)

    # -- memory ------------------------------------------------------------------------------
    def _check(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise InvalidArgumentError(
                f"device {device} does not exist: this daemon has emulated devices 0..{self.devices - 1}"
            )

    def uuid(self, device: int) -> bytes:
        self._check(device)
        return emulated_uuid(device)

    def allocate(self, device: int, nbytes: int) -> EmulatedMemory:
        self._check(device)
        self._context(device)
        fd = os.memfd_create(f"lpsync-emu{device}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            array, mapping = _map(fd, nbytes)
        except OSError as error:
            os.close(fd)
            raise LpsyncError(f"cannot allocate {nbytes} bytes of emulated memory: {error}") from error
        address = array.__array_interface__["data"][0] if nbytes else 0
        return EmulatedMemory(device, nbytes, array, address, mapping, fd, os.fstat(fd).st_ino)

    def allocate_host(self, nbytes: int, device: int | None = None) -> EmulatedMemory:
        # cudaHostAlloc runs in the current device's context: with none named, device 0's.
        self._context(0 if device is None else device)
        array = np.empty(nbytes, np.uint8)
        return EmulatedMemory(-1, nbytes, array, array.__array_interface__["data"][0], None)

    def free(self, memory: EmulatedMemory) -> None:
        self._let_go(memory, "a free", later=True)

    def export(self, memory: EmulatedMemory) -> bytes:
        if memory.fd < 0:
            raise InvalidArgumentError("only an allocation made in this process can be exported")
        return HANDLE.pack(MAGIC, os.getpid(), memory.fd, memory.inode, memory.nbytes, memory.device)

    def open(self, handle: bytes, device: int) -> EmulatedMemory:
        self._check(device)
        try:
            magic, pid, fd, inode, nbytes, on = HANDLE.unpack(handle)
        except struct.error:
            raise InvalidArgumentError(f"not an emulated-device IPC handle ({len(handle)} bytes)") from None
        if magic != MAGIC:
            raise InvalidArgumentError("not an emulated-device IPC handle (bad magic)")
        if on != device:
            raise InvalidArgumentError(f"the allocation is on device {on}, not {device}")
        opened = _open_foreign(
            pid,
            fd,
            _MEMFD_PREFIX,
            "emulated device memory",
            "allocation",
            "has it exited or freed the memory?",
        )
        try:
            st = os.fstat(opened)
            if st.st_ino != inode or st.st_size < nbytes:
                raise NotFoundError(f"process {pid} no longer holds that allocation")
            array, mapping = _map(opened, nbytes)
            fcntl.flock(opened, fcntl.LOCK_SH)  # mapped here: the exporter's free() sees it
        except BaseException:
            os.close(opened)
            raise
        lock = opened
        self._context(device)
        with self._lock:
            self.opens[device] += 1
        address = array.__array_interface__["data"][0] if nbytes else 0
        return EmulatedMemory(
            device, nbytes, array, address, mapping, inode=inode, opened=True, origin=(pid, fd), lock_fd=lock
        )

    def close(self, memory: EmulatedMemory) -> None:
        if memory.opened:
            memory.opened, memory.closed = False, True
            with self._lock:
                self.closes[memory.device] += 1
            self._let_go(memory, "an unmap", later=False)

    def check_mapped(self, memory: EmulatedMemory) -> None:
        """InvalidArgumentError if the process that exported ``memory`` freed it while it
        is mapped here (its exit is not this: the session's end closes the mapping)."""
        if memory.origin is None or memory.closed:
            return
        pid, fd = memory.origin
        try:
            freed = os.stat(f"/proc/{pid}/fd/{fd}").st_ino != memory.inode
        except FileNotFoundError:
            freed = os.path.exists(f"/proc/{pid}")  # the process lives, its descriptor not
        except OSError:
            freed = False
        if freed:
            raise InvalidArgumentError(
                f"process {pid} freed a device allocation while this daemon still maps it "
                "(cudaFree before the registration's release: undefined behaviour on CUDA); "
                "keep the memory alive until release()"
            )

    def _legacy_stream(self, device: int) -> EmulatedStream:
        with self._lock:
            stream = self._legacy.get(device)
            if stream is None:
                stream = self._legacy[device] = EmulatedStream(device)
                self._streams.add(stream)
            return stream

    def wire(self, span: Span) -> np.ndarray:
        view = _view(span)  # device memory is host memory here: any transport carries it
        if span.device < 0:
            return view
        wire = view.view(WireView)
        wire.lpsync_kind, wire.lpsync_memory = self, span.memory
        return wire

    def read(self, span: Span) -> np.ndarray:
        """A pageable device-to-host cudaMemcpy: complete on return, ordered after the
        device's pageable writes (the legacy default stream), not after the kind's streams."""
        self._context(span.device)
        stream = self._legacy.get(span.device)
        if stream is not None:
            done = threading.Event()
            stream.put(done.set)
            done.wait()
        return _view(span).view(span.dtype).copy()

    def write(self, span: Span, data: np.ndarray) -> None:
        """A pageable host-to-device cudaMemcpy: with ``copy_bandwidth`` the bytes land
        after the link's time, after the call returned (CUDA: "the DMA to final destination
        may not have completed"); nothing but ``read`` is ordered after them."""
        self._context(span.device)
        staged = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
        if not self.copy_bandwidth:
            np.copyto(_view(span), staged)
            return
        rate = self.copy_bandwidth

        def land() -> None:
            time.sleep(staged.nbytes / rate)
            np.copyto(_view(span), staged)

        self._legacy_stream(span.device).put(land)

    # -- streams and events ------------------------------------------------------------------
    def stream(self, device: int) -> EmulatedStream:
        self._check(device)
        self._context(device)
        stream = EmulatedStream(device)
        with self._lock:
            self._streams.add(stream)
        return stream

    def destroy_stream(self, stream: EmulatedStream) -> None:
        with self._lock:
            self._streams.discard(stream)
        stream.stop()

    def event(self, device: int) -> EmulatedEvent:
        self._check(device)
        self._context(device)
        return EmulatedEvent(device, self._destroy)

    def ipc_event(self, device: int) -> tuple[EmulatedExportedEvent, bytes]:
        """An own event other processes may open and wait on, and its handle."""
        self._check(device)
        self._context(device)
        event = EmulatedExportedEvent(device, self._destroy)
        return event, event.handle

    def destroy_event(self, event: EmulatedEvent) -> None:
        _alive(event)
        event.destroyed = True
        self._destroy(event.device)
        if isinstance(event, EmulatedExportedEvent):
            self.releaser.put(event.device, event.release)

    def _destroy(self, device: int) -> None:
        """cudaEventDestroy's stand-in, on the Releaser with ``device`` current (a thread
        with another device current, or none, is what CUDA punishes: a fault here)."""

        def destroy() -> None:
            if current_device() != device:
                self._fault(f"an event of device {device} destroyed with device {current_device()} current")
            with self._lock:
                self.destroyed_events += 1

        self.releaser.put(device, destroy)

    def record(self, event: EmulatedEvent, stream: EmulatedStream) -> None:
        _alive(event)
        if event.device != stream.device:  # CUDA: cudaErrorInvalidResourceHandle
            raise InvalidArgumentError(
                f"an event of device {event.device} recorded on a stream of device {stream.device}"
            )
        if stream.capture is not None:  # a node of the graph, no record outside it
            if isinstance(event, EmulatedExportedEvent):
                raise stream.capture.invalidate("an interprocess event recorded in a capture")
            stream.capture.record(stream, event)
            return
        with event._cond:
            event.recorded += 1
            generation = event.recorded
            if isinstance(event, EmulatedExportedEvent):
                event.note_record(generation)  # what another process's wait captures
        stream.put(lambda error: event._complete(generation, error), wants_error=True)

    def open_event(self, handle: bytes, device: int) -> EmulatedIpcEvent:
        self._check(device)
        self._context(device)
        try:
            magic, pid, fd, inode = EVENT_HANDLE.unpack(handle)
        except struct.error:
            raise InvalidArgumentError(f"not an emulated-device event handle ({len(handle)} bytes)") from None
        if magic != EVENT_MAGIC:
            raise InvalidArgumentError("not an emulated-device event handle (bad magic)")
        opened = _open_foreign(pid, fd, _EVENT_PREFIX, "an emulated-device event", "event", "has it exited?")
        try:
            if os.fstat(opened).st_ino != inode:
                raise NotFoundError(f"process {pid} no longer holds that event")
            mapping = mmap.mmap(opened, _EVENT_BYTES)
        finally:
            os.close(opened)
        return EmulatedIpcEvent(np.frombuffer(mapping, np.uint32, 2), mapping, device)

    def close_event(self, event: EmulatedIpcEvent) -> None:
        event.close()

    def wait(self, stream: EmulatedStream, event: EmulatedEvent | EmulatedIpcEvent) -> None:
        captured = getattr(event, "captured", None)
        if captured is not None and captured[0].open:
            capture, node = captured
            if stream.capture is None:  # a stream joins a capture by waiting on its event
                stream.capture = capture
                capture.lanes[stream] = []
            elif stream.capture is not capture:
                raise capture.invalidate("a stream of another capture waited on its event")
            capture.lanes[stream].append(("wait", node))
            return
        if stream.capture is not None:  # CUDA: an event from outside the capture
            raise stream.capture.invalidate("a capturing stream waited on an event recorded outside it")
        if isinstance(event, EmulatedIpcEvent):
            self._wait_ipc(stream, event)
            return
        _alive(event)
        generation = event.recorded
        if generation == 0:
            return  # never recorded: CUDA ignores the wait too

        def waiter() -> None:
            while True:  # wakes at least every second to notice a destroyed stream
                try:
                    event.wait_for(generation, time.monotonic() + 1.0)
                    return
                except CollectiveTimeoutError:
                    if stream.closed.is_set():
                        raise

        stream.put(waiter)

    def _wait_ipc(self, stream: EmulatedStream, event: EmulatedIpcEvent) -> None:
        generation = event.recorded()  # the latest record made so far, as cudaStreamWaitEvent
        if generation == 0:
            return

        def waiter() -> None:
            while not event.reached(generation):  # sleeps in the kernel, 1 s at a time
                if event.closed or stream.closed.is_set():
                    raise UnavailableError(
                        "the client's event was closed before it completed (the client has gone)"
                    )
                event.wait_for(generation, 1.0)

        stream.put(waiter)

    def wait_ready(self, event: EmulatedEvent | EmulatedIpcEvent, deadline: float) -> None:
        if isinstance(event, EmulatedEvent):
            _alive(event)
            _not_captured(event)
            self._status(event.device)
            event.wait_for(event.recorded, deadline)
            self._status(event.device)
            return
        if event.closed:  # a query of a destroyed handle: an error, never "complete"
            raise UnavailableError("the client's event was closed (the client has gone)")
        self._status(event.device)
        generation = event.recorded()  # the latest record now, as cudaEventQuery sees it
        if generation == 0:
            return
        while not event.reached(generation):  # sleeps on the futex; close() wakes it
            if event.closed:
                raise UnavailableError(
                    "the client's event was closed before it completed (the client has gone)"
                )
            self._status(event.device)  # a sticky error is a status: it fails the wait
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeoutError("the client's stream did not reach its ready event in time")
            event.wait_for(generation, min(left, 1.0))

    def synchronize(self, event: EmulatedEvent, deadline: float) -> None:
        _alive(event)
        _not_captured(event)
        self._status(event.device)
        event.wait_for(event.recorded, deadline)
        self._status(event.device)
        if event.error is not None:
            error, event.error = event.error, None
            raise (
                error
                if isinstance(error, LpsyncError)
                else UnavailableError(f"a device operation failed: {error!r}")
            )

    # -- captured programs (CUDA graphs) ------------------------------------------------------
    def begin_capture(self, stream: EmulatedStream) -> None:
        """cudaStreamBeginCapture: ``stream`` and the streams that join it record what
        they are given instead of running it."""
        if stream.capture is not None:
            raise InvalidArgumentError("the stream is capturing already")
        stream.capture = EmulatedCapture(stream)

    def end_capture(self, stream: EmulatedStream) -> EmulatedGraph:
        """cudaStreamEndCapture (+ instantiate): the program, or UnavailableError where the
        capture was invalidated or a stream did not rejoin ``stream``; the capture ends
        either way."""
        capture = stream.capture
        if capture is None or capture.origin is not stream:
            raise InvalidArgumentError("the stream did not begin a capture")
        capture.open = False
        for lane in capture.lanes:
            lane.capture = None
        for event in capture.events:
            event.captured = None
        waited = {node for what, node in capture.lanes[stream] if what == "wait"}
        for lane, nodes in capture.lanes.items():
            if lane is stream or not nodes:
                continue
            last = nodes[-1]
            if last[0] != "record" or last[1] not in waited:
                capture.invalid = capture.invalid or "a stream did not rejoin the origin (unjoined)"
        if capture.invalid is not None:
            raise UnavailableError(f"stream capture failed: {capture.invalid}")
        lanes = [capture.lanes[stream]] + [n for lane, n in capture.lanes.items() if lane is not stream]
        with self._lock:
            self.captures += 1
        return EmulatedGraph(lanes, capture.records)

    def launch_graph(self, graph: EmulatedGraph, stream: EmulatedStream) -> None:
        """cudaGraphLaunch: the whole program as one item of ``stream``."""
        if stream.capture is not None:
            raise stream.capture.invalidate("a graph launched into a capture")
        with self._lock:
            self.graph_launches += 1
        stream.put(lambda: graph.run(stream))

    # -- operations ----------------------------------------------------------------------------
    def copy_async(self, dst: Span, src: Span, stream: EmulatedStream) -> None:
        if dst.nbytes != src.nbytes:
            raise InvalidArgumentError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        self._check_reach(src.device, stream.device)
        self._check_reach(dst.device, stream.device)
        rate = self.copy_bandwidth

        def copy() -> None:
            if rate:  # the link's time first (blocks, does not spin): data lands at the end
                time.sleep(dst.nbytes / rate)
            np.copyto(_view(dst), _view(src))

        stream.put(copy)

    def _check_reach(self, device: int, on: int) -> None:
        """Like a peer copy without peer access, a copy between devices that cannot reach
        each other fails (the engine stages those through host memory)."""
        if device >= 0 and device != on and not self.topology.peer_access(device, on):
            raise InvalidArgumentError(f"device {on} has no peer access to device {device}")
        if (on, device) in self.peer_refused or (device, on) in self.peer_refused:
            raise InvalidArgumentError(f"peer access {on} -> {device} was refused (too many peers)")

    def reduce_async(
        self, reduction: Reduction, out: Span, acc: Span, incoming: Span, final: bool, stream: EmulatedStream
    ) -> None:
        for span in (out, acc, incoming):
            if span.device != stream.device:
                raise InvalidArgumentError("a reduction reads and writes its own device's memory")

        def reduce() -> None:
            target = _view(out).view(reduction.dtype)
            reduction.combine(_view(acc).view(reduction.dtype), _view(incoming).view(reduction.dtype), target)
            if final:
                reduction.finalize(target)

        stream.put(reduce)

    def oneshot_async(
        self, reduction: Reduction, outs: list[Span], inputs: list[Span], stream: EmulatedStream
    ) -> None:
        """The one-shot kernel's twin: refused where it is (kind.oneshot_refusal, and a
        peer pair refused for too many peers), else in rank order with numpy's ufuncs,
        which the kernels match bitwise (tests/memory/test_cuda_contract_kernels.py)."""
        why = oneshot_refusal(outs, inputs, reduction.dtype, stream.device, self.topology)
        if why is not None:
            raise InvalidArgumentError(why)
        for span in inputs:
            self._check_reach(span.device, stream.device)
        if not inputs[0].count:
            return
        dtype = reduction.dtype

        def reduce() -> None:
            # An accumulator apart: an output may be an input that a later step reads
            # (the kernel reads an element's inputs before it writes that element).
            acc = _view(inputs[0]).view(dtype).copy()
            for span in inputs[1:]:
                reduction.combine(acc, _view(span).view(dtype), acc)
            reduction.finalize(acc)
            for out in outs:
                np.copyto(_view(out).view(dtype), acc)

        stream.put(reduce)

    def enable_peer_access(self, device: int, peer: int) -> bool:
        self._context(device)
        self._context(peer)
        with self._lock:
            self.peer_enables += 1
            if (device, peer) in self.peer_enabled:
                return True
            if sum(1 for a, _ in self.peer_enabled if a == device) >= self.max_peers:
                self.peer_refused.add((device, peer))  # cudaErrorTooManyPeers
                return False
            self.peer_enabled.add((device, peer))
            return True

    def recover(self, stream: EmulatedStream) -> None:
        """Clear a poisoned stream once what failed has drained (CUDA cannot: a sticky
        error ends the context)."""
        stream.error = None

    def close_kind(self) -> None:
        with self._lock:
            streams = list(self._streams)
            self._streams.clear()
        for stream in streams:
            stream.stop()
        self.releaser.stop()


def _not_captured(event: EmulatedEvent) -> None:
    """A host wait on an event recorded in a capture still open: CUDA refuses it
    (cudaErrorStreamCaptureUnsupported) and invalidates the capture."""
    captured = event.captured
    if captured is not None and captured[0].open:
        raise captured[0].invalidate("a host wait on an event recorded in the capture")


def _alive(event: EmulatedEvent) -> None:
    if event.destroyed:  # CUDA: cudaErrorInvalidResourceHandle, or worse, another's event
        raise InvalidArgumentError(f"an event of device {event.device} used after it was destroyed")
