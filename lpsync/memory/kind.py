"""The memory-kind operations table: what the engine may do with a kind of memory.

One implementation per kind (STYLE.md #5, after UCC's ``ucc_mc_base.h``): ``emulated``
(host-backed devices, what CI runs), ``cuda`` (a thin mapping onto cupy) and ``host``
(shared memory, synchronous). The engine (lpsync.engine.device_group) plans a collective
once as a list of calls into this table and replays it each run; it never learns which
kind it drives.

Semantics follow the CUDA runtime so that the emulation tests what CUDA will do:
  * work enqueued on one stream runs in order; streams run concurrently;
  * ``record(event, stream)`` marks the point after everything enqueued so far;
    ``wait(stream, event)`` makes later work on ``stream`` wait for the *most recent
    record enqueued before the call* (a wait on a never-recorded event is a no-op, as
    cudaStreamWaitEvent's is) — so a plan must enqueue every record before its waits;
  * an IPC handle names a whole allocation; it opens in another process (never in the
    exporting one on CUDA) and stays valid until closed there (cudaIpcOpenMemHandle /
    cudaIpcCloseMemHandle) provided the exporter does not free the allocation first:
    "calling cudaFree on an exported memory region before calling cudaIpcCloseMemHandle
    in the importing context will result in undefined behavior" (the client's part);
  * every operation runs in the context of the device it names; the daemon must make no
    context on a device it does not serve (CUDA: ~300-500 MB each).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import numpy as np

from lpsync.reduction import Reduction

log = logging.getLogger("lpsync.memory")


class Link(IntEnum):
    """How two devices reach each other, cheapest first (the chain ordering's costs)."""

    SAME = 0  # one device: a local copy
    FAST = 1  # NVLink (or NVSwitch)
    SLOW = 2  # PCIe peer-to-peer
    HOST = 3  # no peer access: staged through pinned host memory


@dataclass(frozen=True)
class Topology:
    """``links[a][b]``: the Link between devices a and b (symmetric, SAME on the diagonal)."""

    links: tuple[tuple[Link, ...], ...]

    @classmethod
    def uniform(cls, n: int, link: Link = Link.FAST) -> Topology:
        return cls(tuple(tuple(Link.SAME if a == b else link for b in range(n)) for a in range(n)))

    def link(self, a: int, b: int) -> Link:
        return self.links[a][b]

    def peer_access(self, a: int, b: int) -> bool:
        return self.links[a][b] != Link.HOST

    def without_peer_access(self, a: int, b: int) -> Topology:
        """The same with a and b staged through host memory (both ways)."""
        links = [list(row) for row in self.links]
        links[a][b] = links[b][a] = Link.HOST
        return Topology(tuple(tuple(row) for row in links))

    def describe(self) -> list[str]:
        names = {Link.SAME: "X", Link.FAST: "NV", Link.SLOW: "PCIe", Link.HOST: "HOST"}
        return [" ".join(names[x] for x in row) for row in self.links]


class Memory(Protocol):
    """One allocation (own or opened through IPC) on ``device``; ``address`` is where it
    starts in this process (a host address for emulated/host, a device pointer for cuda)."""

    device: int
    nbytes: int
    address: int


@dataclass(frozen=True)
class Span:
    """``count`` elements of ``dtype`` at byte ``offset`` of ``memory``: what the engine moves.

    Slicing gives sub-spans (so lpsync.engine.group.layout works on spans as on arrays).
    """

    memory: Any  # a Memory of the kind that made it
    offset: int
    count: int
    dtype: np.dtype

    @property
    def device(self) -> int:
        return self.memory.device

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    @property
    def size(self) -> int:
        return self.count

    @property
    def lo(self) -> int:
        return self.memory.address + self.offset

    @property
    def hi(self) -> int:
        return self.lo + self.nbytes

    def __getitem__(self, item: slice) -> Span:
        start, stop, step = item.indices(self.count)
        if step != 1:
            raise ValueError("spans slice contiguously")
        return Span(self.memory, self.offset + start * self.dtype.itemsize, max(0, stop - start), self.dtype)


class MemoryKind(Protocol):
    """The operations table. Every method may be called from any thread."""

    name: str  # "emulated", "cuda", "host"
    devices: int  # device count; indices 0..devices-1 are this daemon's devices
    topology: Topology

    def uuid(self, device: int) -> bytes:
        """The device's 16-byte UUID (cuDeviceGetUuid): how clients name it, whatever
        ordinal they see it under."""

    def allocate(self, device: int, nbytes: int) -> Memory:
        """Device memory owned by the caller (staging, TMP); freed by ``free``."""

    def allocate_host(self, nbytes: int, device: int) -> Memory:
        """Host memory the devices copy to and from asynchronously (pinned on CUDA, usable
        by every device); allocated in ``device``'s context, a device the daemon serves."""

    def free(self, memory: Memory) -> None:
        """Hand ``memory`` to the kind's Releaser and return at once: cudaFree and
        cudaFreeHost synchronize the device, and the caller may be the event loop."""

    def export(self, memory: Memory) -> bytes:
        """The IPC handle of ``memory`` (an allocation's base), for another process."""

    def open(self, handle: bytes, device: int) -> Memory:
        """Map an allocation exported by another process; InvalidArgumentError if the
        handle is not one (or not on ``device``)."""

    def close(self, memory: Memory) -> None:
        """Unmap what ``open`` mapped; the exporter's allocation lives on."""

    def stream(self, device: int) -> Any:
        """A new stream on ``device``, dedicated to its caller; ``destroy_stream`` ends it."""

    def destroy_stream(self, stream: Any) -> None: ...

    def event(self, device: int) -> Any:
        """A new event (no timing) of ``device``, reusable: recorded again on every run.
        An event belongs to the device it was made on (cudaEventRecord needs event and
        stream in one context): recording it on another device's stream fails."""

    def ipc_event(self, device: int) -> tuple[Any, bytes]:
        """A new own event of ``device`` that other processes may open (CUDA:
        cudaEventInterprocess, its cudaIpcGetEventHandle): (event, handle). Recorded,
        waited on and destroyed like ``event``'s; a client's stream waits on its latest
        record (a stream-ordered collective's "done" event)."""

    def open_event(self, handle: bytes, device: int) -> Any:
        """Open an event another process exported (cudaIpcOpenEventHandle); ``wait`` takes
        it like an own event. InvalidArgumentError/NotFoundError for a bad or dead handle."""

    def wait_ready(self, event: Any, deadline: float) -> None:
        """Block the host until an opened client event's latest record completed, by
        polling it (cudaEventQuery), never through a daemon stream: the streams are shared
        by every job, and a stream waiting on the event of a client that died may never
        move again. CollectiveTimeoutError at ``deadline``; UnavailableError once closed."""

    def close_event(self, event: Any) -> None:
        """Release an opened event; a stream still waiting on it is released too. Any
        later query of it is an error (CUDA: a use after free of the handle)."""

    def destroy_event(self, event: Any) -> None:
        """End an own event (``event``) on the kind's Releaser, with its device current;
        recording, waiting on or querying it afterwards is an error. An event dropped
        without it is destroyed there too (CUDA: never by the garbage collector on the
        event loop, where no device is current and device 0's context would be made)."""

    def bind_thread(self, device: int) -> None:
        """Make ``device`` (its primary context) current in the calling thread: a thread
        the kind does not own (the UCX progress thread) must before it touches device
        memory (CUDA: UCX's cuda transports query pointers and events in the caller's
        context; without one, a segfault, nixl#2102)."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark ``stream``'s work so far; the event must be of the stream's device."""

    def wait(self, stream: Any, event: Any) -> None:
        """Later work on ``stream`` waits for ``event``'s latest record enqueued so far."""

    def synchronize(self, event: Any, deadline: float) -> None:
        """Block the host until ``event``'s latest record completed; raises
        CollectiveTimeoutError at ``deadline`` (time.monotonic) and the stream's error if
        an operation failed."""

    def copy_async(self, dst: Span, src: Span, stream: Any) -> None:
        """dst = src (same byte count), on ``stream``; peer copy across devices, D2H/H2D
        with host memory."""

    def reduce_async(
        self, reduction: Reduction, out: Span, acc: Span, incoming: Span, final: bool, stream: Any
    ) -> None:
        """out = acc (op) incoming, then (``final``) the avg division; on ``stream``'s device."""

    def oneshot_async(
        self, reduction: Reduction, outs: Sequence[Span], inputs: Sequence[Span], stream: Any
    ) -> None:
        """Every out = inputs[0] (op) inputs[1] (op) ... in that order, then (avg) divided
        once by the participant count: one launch on ``stream``'s device (issue 47, item 3),
        reading inputs of peer devices where peer access allows. InvalidArgumentError, at
        the call, for what ``oneshot_refusal`` refuses (outputs may be inputs themselves)."""

    def enable_peer_access(self, device: int, peer: int) -> bool:
        """Let ``device`` read ``peer``'s memory (a pair with a peer link); False when the
        device has no room for another peer (cudaErrorTooManyPeers: 8 on PCIe boxes), the
        pair is then staged through host memory. Called once per pair (DeviceContext)."""

    def wire(self, span: Span) -> Any:
        """``span`` as the peer plane's transport takes it, without a copy: a uint8 numpy
        view of host memory (emulated, host), a uint8 cupy array of device memory (cuda:
        UCX moves it with its cuda transports). Only where the daemon's device path is
        ``device`` (lpsync.transport.ucx.device_support) do device spans go to the wire."""

    def read(self, span: Span) -> np.ndarray:
        """A host copy of ``span`` (synchronous; host staging and the bench's verification)."""

    def write(self, span: Span, data: np.ndarray) -> None:
        """span = data, as a pageable cudaMemcpy: it may return before the bytes landed
        (only a later ``read`` is ordered after them, not the kind's streams). Tests and
        verification only: a result a client is answered on goes through pinned host
        memory, ``copy_async`` and an event (lpsync.engine.staging.move)."""

    def close_kind(self) -> None:
        """End every stream and free what the kind holds (daemon shutdown)."""

    # Optional (emulated, cuda; the engine asks with getattr): captured programs.
    # begin_capture(stream): cudaStreamBeginCapture; streams that wait on an event recorded
    #     in the capture join it; waits on events recorded outside it, host waits on its
    #     events and allocations are refused (the capture is invalidated).
    # end_capture(stream) -> graph: cudaStreamEndCapture + instantiate; raises where the
    #     capture was invalidated or a joined stream did not rejoin ``stream``.
    # launch_graph(graph, stream): cudaGraphLaunch, the whole program one item of ``stream``.


def oneshot_refusal(
    outs: Sequence[Span],
    inputs: Sequence[Span],
    dtype: np.dtype,
    device: int,
    topology: Topology,
    in_place: bool = True,
) -> str | None:
    """Why one one-shot launch on ``device`` cannot write ``outs`` from ``inputs`` (None:
    it can). Both kinds refuse by this, and the runner asks it before choosing the path:
    at most ONESHOT_MAX of each (the kernel's parameters), one count and dtype, outputs on
    ``device``, inputs there or on a peer it reaches directly (no host staging), outputs
    apart from each other and from every input, except that an output may be exactly an
    input where ``in_place`` (the launch that reads it is the only one: each element is
    read before it is written by the same thread; with a launch per device another one
    might still read what this one overwrote)."""
    from lpsync.memory.cuda_kernels import DTYPES, ONESHOT_MAX  # plain source: no cupy

    if not inputs or not outs or len(inputs) > ONESHOT_MAX or len(outs) > ONESHOT_MAX:
        return f"a one-shot launch takes 1..{ONESHOT_MAX} inputs and outputs"
    if dtype.name not in DTYPES:
        return f"no one-shot kernel for {dtype.name}"
    count = inputs[0].count
    if any(span.count != count or span.dtype != dtype for span in (*inputs, *outs)):
        return "a one-shot launch needs one count and dtype throughout"
    if any(out.device != device for out in outs):
        return "a one-shot launch writes its own device's memory only"
    for span in inputs:
        if span.device < 0 or (span.device != device and not topology.peer_access(span.device, device)):
            return f"device {device} cannot read device {span.device}'s memory directly"
    if not count:
        return None
    for k, out in enumerate(outs):
        if any(out.lo < other.hi and other.lo < out.hi for other in outs[k + 1 :]):
            return "one-shot outputs overlap each other"
        for span in inputs:
            if (
                out.lo < span.hi
                and span.lo < out.hi
                and not (in_place and (out.lo, out.hi) == (span.lo, span.hi))
            ):
                return "a one-shot output overlaps an input"
    return None


class Releaser:
    """The one thread of a kind that frees device memory and destroys events.

    Why a thread: cudaFree and cudaFreeHost synchronize the whole device, so a free on the
    event loop stalls every RPC behind the slowest stream; and a destroy needs its object's
    device current (``bind``): a thread without one would make device 0's context. Work
    runs in order; ``flush`` waits (bounded) until what was handed in before is done.
    Started at the first hand-off; a failure is logged, never raised to the caller who
    has long moved on.
    """

    def __init__(self, name: str, bind: Callable[[int], None]) -> None:
        self.name, self._bind = name, bind
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._handed = self._done = 0
        self._thread: threading.Thread | None = None
        self._stopped = False

    def put(self, device: int, work: Callable[[], None]) -> None:
        """Run ``work`` on the thread with ``device`` current (< 0: no device needed)."""
        with self._cond:
            if self._stopped:
                stopped = True
            else:
                stopped = False
                self._handed += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                self._queue.put((device, work))
        if stopped:  # after close_kind: nothing else will run it
            self._run_one(device, work)

    def flush(self, timeout: float = 10.0) -> bool:
        """Until everything handed in so far ran; False at ``timeout``."""
        with self._cond:
            target = self._handed
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run_one(self, device: int, work: Callable[[], None]) -> None:
        try:
            if device >= 0:
                self._bind(device)
            work()
        except Exception:
            log.exception("%s: a release failed", self.name)

    def _run(self) -> None:
        while True:
            item = self._queue.get()  # blocks: no polling
            if item is None:
                return
            self._run_one(*item)
            with self._cond:
                self._done += 1
                self._cond.notify_all()
