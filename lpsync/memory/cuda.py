"""The CUDA memory kind: kind.py's operations table as a thin mapping onto cupy.

Imported only for ``--devices cuda:...`` (lpsync[cuda12] / lpsync[cuda13] install cupy).
NOT YET RUN ON A GPU: written and reviewed against the CUDA runtime and cupy documentation
(docs/gpu.md lists each call and what it relies on). Device numbering is the CUDA ordinal
as the daemon sees it; clients must see the same numbering (same CUDA_VISIBLE_DEVICES).

  allocate / free          cupy.cuda.runtime.malloc / free (not cupy's pool: a staging
                           buffer is ours for the daemon's lifetime)
  allocate_host            cupy.cuda.runtime.hostAlloc(n, cudaHostAllocPortable) in the
                           named device's context (pinned: async D2H/H2D need it; portable:
                           pinned for every device's context, not only the allocating one)
  export                   runtime.ipcGetMemHandle(base) (64 bytes naming the allocation)
  open / close             runtime.ipcOpenMemHandle(handle, cudaIpcMemLazyEnablePeerAccess)
                           on the allocation's device / runtime.ipcCloseMemHandle; one open
                           per allocation per process (the registry caches it): CUDA refuses
                           a second open of the same handle in one context
  stream                   cupy.cuda.Stream(non_blocking=True) on the device: never
                           synchronises with the legacy default stream
  event / record / wait    runtime.eventCreateWithFlags(blocking sync | disable timing) in
                           a CudaEvent, runtime.eventRecord, runtime.streamWaitEvent (the
                           latest record); destroyed (runtime.eventDestroy) on the kind's
                           Releaser with its device current, whether by destroy_event or
                           when dropped: never by the garbage collector on whatever thread
                           (the event loop) let go of a plan
  free                     on the Releaser too: cudaFree/cudaFreeHost synchronize the device
  ipc_event                eventCreateWithFlags(... | cudaEventInterprocess) and
                           runtime.ipcGetEventHandle: the "done" event of a stream-ordered
                           collective, opened and waited on by the client (issue 47, item 1)
  open_event / close_event runtime.ipcOpenEventHandle(handle) on the event's device (a
                           client's Event(interprocess=True, disable_timing=True)) /
                           runtime.eventDestroy; ``wait`` on it is
                           runtime.streamWaitEvent(stream, event, 0)
  synchronize              runtime.eventQuery first (complete: return at once); else the
                           record's stream's waiter thread (StreamWaiter: runtime.
                           eventSynchronize, blocking sync, on each record in the order the
                           stream completes them; handed each record of a host-waited event
                           as it is made) wakes the caller, who waits with its deadline: one
                           wake-up per wait, no pool (the first reading's 4 helpers, then
                           256, queued waits behind each other and timed them out)
  wait_ready / queries     every status other than cudaSuccess and cudaErrorNotReady fails
                           the wait, whether cupy returns it or raises it; a closed event is
                           never queried again (a use after free of the handle)
  begin_capture / end_capture / launch_graph
                           Stream.begin_capture(mode=streamCaptureModeThreadLocal),
                           Stream.end_capture() -> cupy.cuda.Graph, Graph.launch(stream): a
                           plan's operations captured once, replayed per collective
  copy_async               runtime.memcpyPeerAsync across devices, memcpyAsync on one device
                           or with pinned host memory
  oneshot_async            cuda_kernels' one-shot kernel: one launch reads every input (peer
                           ones through peer access) and writes the device's outputs
  reduce_async             cuda_kernels' raw kernels (every served dtype and op, one
                           cupy.RawModule, float16/bfloat16 as their 16-bit words) launched
                           on raw device pointers with stream=: no cupy array per call;
                           compiled and loaded on every served device at start on a
                           background thread (``warm``), not inside a deadline
  bind_thread              runtime.setDevice: makes the device's primary context current in
                           a thread the kind does not own (the UCX progress thread)
  enable_peer_access       runtime.deviceEnablePeerAccess (cudaErrorPeerAccessAlreadyEnabled
                           ignored)
  topology                 nvidia-ml-py when installed: nvmlDeviceGetP2PStatus(NVLINK) ->
                           FAST; else deviceCanAccessPeer -> SLOW; else HOST (staged)

Every call runs with the device it concerns current in the calling thread (``_use``), and
never with device 0 current unless device 0 is served: a runtime call that needs a context
creates the current device's primary context (~300-500 MB of GPU memory), and a thread
starts with device 0 current. So no ``with cupy.cuda.Device(d)``: its ``__exit__`` calls
cudaSetDevice(previous), which in a fresh thread is device 0 and since CUDA 12 initializes
its primary context. The device is set and left set (the daemon's threads have no other
use for a current device); the waiter threads set their stream's device first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lpsync.errors import (
    CollectiveTimeoutError,
    ConfigError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from lpsync.memory import cuda_kernels
from lpsync.memory.kind import Link, Releaser, Span, Topology, oneshot_refusal
from lpsync.reduction import Reduction
from lpsync.types import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable

try:
    import cupy
    from cupy.cuda import runtime
except ImportError as error:  # pragma: no cover - depends on the install
    raise ConfigError(
        f"--devices cuda needs cupy: pip install 'lpsync[cuda12]' (or lpsync[cuda13]) ({error})"
    ) from None

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_NOT_READY = 600  # cudaErrorNotReady
_TOO_MANY_PEERS = 711  # cudaErrorTooManyPeers
_HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable
_EVENT_FLAGS = 0x1 | 0x2  # cudaEventBlockingSync | cudaEventDisableTiming
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
_INTERPROCESS = 0x4  # cudaEventInterprocess: "must be specified along with cudaEventDisableTiming"


def _use(device: int) -> None:
    """Make ``device`` current in this thread and leave it current (module docstring).
    cudaGetDevice only reads the thread's setting; it makes no context."""
    if runtime.getDevice() != device:
        runtime.setDevice(device)


@dataclass(eq=False)
class CudaMemory:
    device: int  # CUDA ordinal; -1 for pinned host memory
    nbytes: int
    address: int
    how: str  # "malloc", "ipc", "host"
    closed: bool = False  # an IPC mapping closed: the address is no longer ours
    context: int = -1  # pinned host memory: the device whose context allocated it


@dataclass(eq=False)
class CudaIpcEvent:
    """An event opened from another process's cudaIpcGetEventHandle."""

    device: int
    pointer: int  # cudaEvent_t in this process
    closed: bool = False  # destroyed: the handle must never be queried again


class CudaEvent:
    """An own event (cudaEvent_t ``ptr`` of ``device``). Dropped without ``destroy_event``,
    it hands its handle to the kind's Releaser, never destroying it on the dropping thread.

    Host waits (``synchronize``): ``recorded`` counts its records, ``completed`` the latest
    one a waiter saw complete; once an event has been waited on from the host
    (``host_waited``), each later record is handed to its stream's waiter (StreamWaiter)
    as it is made, so a wait is one wake-up: the waiter's."""

    __slots__ = (
        "_drop",
        "completed",
        "cond",
        "destroyed",
        "device",
        "doomed",
        "error",
        "host_waited",
        "ptr",
        "queued",
        "recorded",
        "stream",
        "upto",
    )

    def __init__(self, device: int, ptr: int, drop: Callable[[int, int], None]) -> None:
        self.device, self.ptr, self._drop, self.destroyed = device, ptr, drop, False
        self.cond = threading.Condition()
        self.recorded = self.completed = 0
        self.upto = 0  # the latest record handed to a waiter
        self.queued = 0  # records handed to a waiter and not yet seen complete
        self.host_waited = self.doomed = False  # doomed: destroyed once the waiter let go
        self.stream: cupy.cuda.Stream | None = None  # of the latest record
        self.error: UnavailableError | None = None

    def __del__(self) -> None:
        if not self.destroyed:
            self.destroyed = True
            self._drop(self.device, self.ptr)


class StreamWaiter:
    """The host's wait for one stream's events: a thread blocked in cudaEventSynchronize
    (blocking sync: it sleeps) on each record handed to it, in the order they were made,
    which is the order one stream completes them, so no wait queues behind another
    stream's. Started at the first host wait on the stream, ended with the stream."""

    def __init__(self, kind: CudaKind, stream: cupy.cuda.Stream) -> None:
        self.kind, self.device = kind, stream.lpsync_device
        self._queue: queue.SimpleQueue[tuple[CudaEvent, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lpsync-cuda-wait-{self.device}", daemon=True)
        self._thread.start()

    def put(self, event: CudaEvent, generation: int) -> None:
        self._queue.put((event, generation))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        _use(self.device)  # a fresh thread has device 0 current
        while True:
            item = self._queue.get()  # blocks: no polling
            if item is None:
                return
            event, generation = item
            error: UnavailableError | None = None
            latest = generation
            if not event.destroyed:
                with event.cond:
                    latest = max(generation, event.recorded)  # what the synchronize covers
                try:
                    runtime.eventSynchronize(event.ptr)
                    query(event.ptr)  # a status the synchronize may have returned quietly
                except runtime.CUDARuntimeError as failure:
                    error = UnavailableError(f"a GPU operation failed: {failure}")
                except UnavailableError as failure:
                    error = failure
            with event.cond:
                event.queued -= 1
                if error is None:
                    event.completed = max(event.completed, latest)
                else:
                    event.error = error  # sticky, as the context's error is
                event.cond.notify_all()
                doomed = event.doomed and event.queued == 0
            if doomed:  # destroyed while handed to this thread: now nothing uses it
                self.kind._drop_event(event.device, event.ptr)
            del event, item


def query(pointer: int) -> bool:
    """cudaEventQuery: True when complete, False when not yet; any other status raises
    UnavailableError. cupy returns some statuses rather than raising them (the first
    reading's wait polled a failed event until its deadline), so both are checked."""
    try:
        status = runtime.eventQuery(pointer)
    except runtime.CUDARuntimeError as error:
        status = getattr(error, "status", -1)
        if status != _NOT_READY:
            raise UnavailableError(f"a CUDA event reports an error: {error}") from None
    if status == 0:
        return True
    if status == _NOT_READY:
        return False
    raise UnavailableError(f"a CUDA event reports error status {status}")


class CudaKind:
    name = "cuda"

    def __init__(self, indices: Sequence[int] = ()) -> None:
        count = runtime.getDeviceCount()
        if count == 0:
            raise ConfigError("--devices cuda: no CUDA device is visible")
        allowed = tuple(indices) or tuple(range(count))
        missing = [i for i in allowed if i >= count]
        if missing:
            raise ConfigError(f"--devices cuda: GPUs {missing} do not exist ({count} visible)")
        self.devices, self.allowed = count, frozenset(allowed)
        # A served device current first: whatever the queries below need, no context on an
        # unserved device (device 0 is current in a fresh thread).
        self.home = min(allowed)
        _use(self.home)
        self.topology = _topology(count)
        # Per device: every reduction kernel (cuda_kernels), by (reduce op, dtype name, what).
        self._kernels: dict[int, dict[tuple[ReduceOp, str, str], Any]] = {}
        self._module: Any = None  # cupy.RawModule of cuda_kernels.source(), made once
        self._compiling = threading.Lock()
        self._lock = threading.Lock()
        self.waiters: dict[int, StreamWaiter] = {}  # id(stream) -> its waiter (host waits)
        self.handoffs = 0  # host waits that had to hand their record to a waiter themselves
        self.releaser = Releaser("lpsync-cuda-release", _use)
        self.opens = [0] * count
        self.closes = [0] * count
        self.peer_refused: set[tuple[int, int]] = set()  # cudaErrorTooManyPeers: no direct reads
        # Every reduction kernel compiled now, off every collective's deadline (NVRTC takes
        # ~0.1-1 s a module); a collective that comes first waits for its device's.
        self._warming = threading.Thread(target=self.warm, name="lpsync-cuda-warm", daemon=True)
        self._warming.start()

    def warm(self) -> None:
        """Compile and load every reduction kernel (cuda_kernels: each served dtype and op,
        one module) on every served device, each with its device current: a module is
        loaded into one device's context."""
        for device in sorted(self.allowed):
            try:
                self._kernels_on(device)
            except Exception as error:  # compiled by the first collective instead
                import logging

                logging.getLogger("lpsync.memory").warning("compiling reduction kernels: %r", error)
                return

    def _kernels_on(self, device: int) -> dict[tuple[ReduceOp, str, str], Any]:
        kernels = self._kernels.get(device)
        if kernels is not None:
            return kernels
        with self._compiling:
            kernels = self._kernels.get(device)
            if kernels is None:
                _use(device)
                if self._module is None:
                    self._module = cupy.RawModule(code=cuda_kernels.source())
                # get_function compiles the module (once, cached by cupy) and loads the
                # kernel into the current device's context.
                loaded = {name: self._module.get_function(name) for name in cuda_kernels.names()}
                kernels = {}
                for op in ReduceOp:
                    for name in cuda_kernels.DTYPES:
                        kernels[op, name, "combine"] = loaded[cuda_kernels.combine_name(op, name)]
                        kernels[op, name, "divide"] = loaded[cuda_kernels.divide_name(name)]
                        kernels[op, name, "oneshot"] = loaded[cuda_kernels.oneshot_name(op, name)]
                self._kernels[device] = kernels
        return kernels

    def bind_thread(self, device: int) -> None:
        self._check(device)
        _use(device)

    def _check(self, device: int) -> None:
        if device not in self.allowed:
            raise InvalidArgumentError(
                f"GPU {device} is not served by this daemon "
                f"(--devices cuda:{','.join(map(str, sorted(self.allowed)))})"
            )

    def uuid(self, device: int) -> bytes:
        from lpsync_client.wire import device_uuid  # the driver's cuDeviceGetUuid

        return device_uuid(device)

    # -- memory ------------------------------------------------------------------------------
    def allocate(self, device: int, nbytes: int) -> CudaMemory:
        self._check(device)
        _use(device)
        return CudaMemory(device, nbytes, runtime.malloc(max(nbytes, 1)), "malloc")

    def allocate_host(self, nbytes: int, device: int = -1) -> CudaMemory:
        on = device if device in self.allowed else self.home
        _use(on)
        address = runtime.hostAlloc(max(nbytes, 1), _HOST_ALLOC_PORTABLE)
        return CudaMemory(-1, nbytes, address, "host", context=on)

    def free(self, memory: CudaMemory) -> None:
        # On the Releaser (it makes the device current): both synchronize the device.
        if memory.how == "host":
            self.releaser.put(memory.context, lambda: runtime.freeHost(memory.address))
        elif memory.how == "malloc":
            self.releaser.put(memory.device, lambda: runtime.free(memory.address))

    def export(self, memory: CudaMemory) -> bytes:
        _use(memory.device)
        return bytes(runtime.ipcGetMemHandle(memory.address))

    def open(self, handle: bytes, device: int) -> CudaMemory:
        self._check(device)
        if len(handle) != 64:
            raise InvalidArgumentError(f"a CUDA IPC handle has 64 bytes, not {len(handle)}")
        try:
            _use(device)
            address = runtime.ipcOpenMemHandle(handle, _LAZY_PEER)
        except runtime.CUDARuntimeError as error:
            raise NotFoundError(
                f"cannot open the CUDA IPC handle on GPU {device}: {error} "
                "(has its process exited or freed it?)"
            ) from None
        with self._lock:
            self.opens[device] += 1
        # The size is the client's word (RegisterRequest.allocation_bytes): the registry
        # bounds spans by it.
        return CudaMemory(device, 1 << 62, address, "ipc")

    def close(self, memory: CudaMemory) -> None:
        if memory.how != "ipc":
            return
        _use(memory.device)
        runtime.ipcCloseMemHandle(memory.address)
        memory.closed = True
        with self._lock:
            self.closes[memory.device] += 1

    def read(self, span: Span) -> np.ndarray:
        host = np.empty(span.nbytes, np.uint8)
        _use(span.device)
        runtime.memcpy(host.ctypes.data, span.lo, span.nbytes, _D2H)  # complete on return
        return host.view(span.dtype)

    def write(self, span: Span, data: np.ndarray) -> None:
        # Pageable: may return before the DMA landed (kind.py); tests and verification only.
        host = np.ascontiguousarray(data)
        _use(span.device)
        runtime.memcpy(span.lo, host.ctypes.data, span.nbytes, _H2D)

    # -- streams and events ------------------------------------------------------------------
    def stream(self, device: int) -> cupy.cuda.Stream:
        self._check(device)
        _use(device)
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.lpsync_device = device
        return stream

    def destroy_stream(self, stream: cupy.cuda.Stream) -> None:
        _use(stream.lpsync_device)
        stream.synchronize()
        with self._lock:
            waiter = self.waiters.pop(id(stream), None)
        if waiter is not None:
            waiter.stop()

    def _waiter(self, stream: cupy.cuda.Stream) -> StreamWaiter:
        with self._lock:
            waiter = self.waiters.get(id(stream))
            if waiter is None:
                waiter = self.waiters[id(stream)] = StreamWaiter(self, stream)
            return waiter

    def event(self, device: int) -> CudaEvent:
        # An event belongs to the device current when it is made: make it on ``device``.
        self._check(device)
        _use(device)
        return CudaEvent(device, runtime.eventCreateWithFlags(_EVENT_FLAGS), self._drop_event)

    def ipc_event(self, device: int) -> tuple[CudaEvent, bytes]:
        """An own event another process may open (cudaEventInterprocess | DisableTiming |
        BlockingSync) and its cudaIpcGetEventHandle: a stream-ordered collective's "done"
        event, which the client's stream waits on (cudaStreamWaitEvent) after the answer."""
        self._check(device)
        _use(device)
        pointer = runtime.eventCreateWithFlags(_EVENT_FLAGS | _INTERPROCESS)
        event = CudaEvent(device, pointer, self._drop_event)
        return event, bytes(runtime.ipcGetEventHandle(event.ptr))

    def timing_event(self, device: int) -> CudaEvent:
        """An event with timing (benchmarks: runtime.eventElapsedTime), else as ``event``."""
        self._check(device)
        _use(device)
        return CudaEvent(device, runtime.eventCreateWithFlags(0x1), self._drop_event)

    def _drop_event(self, device: int, pointer: int) -> None:
        self.releaser.put(device, lambda: runtime.eventDestroy(pointer))

    def destroy_event(self, event: CudaEvent) -> None:
        with event.cond:
            if event.destroyed:
                raise InvalidArgumentError("an event destroyed twice")
            event.destroyed = True
            event.doomed = event.queued > 0  # a waiter still holds it: it destroys it after
        if not event.doomed:
            self._drop_event(event.device, event.ptr)

    def open_event(self, handle: bytes, device: int) -> CudaIpcEvent:
        self._check(device)
        if len(handle) != 64:
            raise InvalidArgumentError(f"a CUDA IPC event handle has 64 bytes, not {len(handle)}")
        try:
            _use(device)
            return CudaIpcEvent(device, runtime.ipcOpenEventHandle(handle))
        except runtime.CUDARuntimeError as error:
            raise NotFoundError(
                f"cannot open the client's CUDA IPC event on GPU {device}: "
                f"{error} (made with interprocess=True? has it exited?)"
            ) from None

    def close_event(self, event: CudaIpcEvent) -> None:
        if event.closed:
            return
        event.closed = True
        _use(event.device)
        runtime.eventDestroy(event.pointer)  # pending waits on it still complete

    def wait_ready(self, event: CudaIpcEvent, deadline: float) -> None:
        # Polled from the host (cudaEventQuery), never a daemon stream's
        # cudaStreamWaitEvent: those streams are shared by every job. The pause backs off
        # from 5 us to 200 us: a client's event mostly completes within microseconds.
        pause = 5e-6
        _use(event.device)
        while True:
            if event.closed:
                raise UnavailableError("the client's event was closed (the client has gone)")
            if query(event.pointer):  # raises on any status but ready / not ready
                return
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError("the client's stream did not reach its ready event in time")
            time.sleep(pause)
            pause = min(pause * 2, 200e-6)

    def record(self, event: CudaEvent, stream: cupy.cuda.Stream) -> None:
        if event.destroyed:
            raise InvalidArgumentError("an event recorded after it was destroyed")
        if event.device != stream.lpsync_device:  # CUDA would fail the record
            raise InvalidArgumentError(
                f"an event of GPU {event.device} recorded on a stream of GPU {stream.lpsync_device}"
            )
        _use(stream.lpsync_device)
        runtime.eventRecord(event.ptr, stream.ptr)
        with event.cond:
            event.recorded += 1
            event.stream = stream
            handed = event.host_waited  # waited on from the host before: its waiter takes it now
            if handed:
                event.upto = event.recorded
                event.queued += 1
        if handed:
            self._waiter(stream).put(event, event.upto)

    def wait(self, stream: cupy.cuda.Stream, event: CudaEvent | CudaIpcEvent) -> None:
        if event.closed if isinstance(event, CudaIpcEvent) else event.destroyed:
            raise InvalidArgumentError("a wait on an event that was destroyed")
        _use(stream.lpsync_device)
        pointer = event.pointer if isinstance(event, CudaIpcEvent) else event.ptr
        runtime.streamWaitEvent(stream.ptr, pointer, 0)

    def synchronize(self, event: CudaEvent, deadline: float) -> None:
        """Until the latest record completed. Done already (cudaEventQuery): no hand-off at
        all. Else the stream's waiter has it (handed at record time, once the event was
        waited on from the host: plans replay the same events, so from their second run
        on), or gets it now; this thread sleeps until the waiter saw it complete, or the
        deadline: one wake-up per wait, and a stream that never finishes holds only the
        waits on its own records."""
        with event.cond:
            if event.destroyed:
                raise InvalidArgumentError("a synchronize on an event that was destroyed")
            generation = event.recorded
            if event.error is not None:
                raise event.error
            if generation == 0 or event.completed >= generation:
                return  # never recorded (cudaEventSynchronize returns at once), or seen done
        _use(event.device)
        if query(event.ptr):  # an error status raises here
            with event.cond:
                event.completed = max(event.completed, generation)
            return
        with event.cond:
            event.host_waited = True
            hand = event.upto < generation
            if hand:
                event.upto = generation
                event.queued += 1
                self.handoffs += 1
            stream = event.stream
        if hand:
            assert stream is not None
            self._waiter(stream).put(event, generation)
        with event.cond:
            while event.completed < generation and event.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError("the GPU streams did not finish in time")
                event.cond.wait(left)
            if event.error is not None:
                raise event.error

    # -- captured programs (CUDA graphs, issue 47 item 2) --------------------------------------
    def begin_capture(self, stream: cupy.cuda.Stream) -> None:
        """cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) through cupy's
        Stream.begin_capture: the daemon's other threads go on with their own calls (the
        global mode would refuse their allocations meanwhile); this thread makes none."""
        _use(stream.lpsync_device)
        stream.begin_capture(mode=_CAPTURE_THREAD_LOCAL)

    def end_capture(self, stream: cupy.cuda.Stream) -> Any:
        """cudaStreamEndCapture, instantiated: cupy's Graph (an invalidated or unjoined
        capture raises here, and the capture is over)."""
        _use(stream.lpsync_device)
        return stream.end_capture()

    def launch_graph(self, graph: Any, stream: cupy.cuda.Stream) -> None:
        """cudaGraphLaunch: the whole program, ordered after ``stream``'s earlier work
        and before its later work."""
        _use(stream.lpsync_device)
        graph.launch(stream)

    # -- operations ----------------------------------------------------------------------------
    def copy_async(self, dst: Span, src: Span, stream: cupy.cuda.Stream) -> None:
        n = dst.nbytes
        if n != src.nbytes:
            raise InvalidArgumentError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        if not n:
            return
        _use(stream.lpsync_device)
        if dst.device >= 0 and src.device >= 0 and dst.device != src.device:
            runtime.memcpyPeerAsync(dst.lo, dst.device, src.lo, src.device, n, stream.ptr)
        else:
            kind = _D2D if dst.device >= 0 and src.device >= 0 else (_D2H if dst.device < 0 else _H2D)
            runtime.memcpyAsync(dst.lo, src.lo, n, kind, stream.ptr)

    def wire(self, span: Span) -> cupy.ndarray:
        if span.device < 0:
            raise InvalidArgumentError("the wire takes device spans of a cuda kind; host spans are numpy's")
        if span.memory.how == "ipc":  # UCX's registration cache does not see cudaIpcCloseMemHandle
            raise InvalidArgumentError("the wire takes the daemon's own device memory, not an IPC mapping")
        return self._array(span, np.dtype(np.uint8))  # __cuda_array_interface__: ucxx posts it as is

    def _array(self, span: Span, dtype: np.dtype) -> cupy.ndarray:
        memory = cupy.cuda.UnownedMemory(span.lo, span.nbytes, None, span.device)
        return cupy.ndarray((span.nbytes // dtype.itemsize,), dtype, cupy.cuda.MemoryPointer(memory, 0))

    def reduce_async(
        self,
        reduction: Reduction,
        out: Span,
        acc: Span,
        incoming: Span,
        final: bool,
        stream: cupy.cuda.Stream,
    ) -> None:
        """The kernels take raw device pointers: no cupy array per reduction; compiled at
        start (``warm``), so none compiles here after the first moments of the daemon."""
        n = out.count
        if not n:
            return
        device = stream.lpsync_device
        kernels = self._kernels_on(device)
        name, op = reduction.dtype.name, reduction.op
        _use(device)
        grid, block = (min(4096, (n + 255) // 256),), (256,)
        pointers = (np.uint64(acc.lo), np.uint64(incoming.lo), np.uint64(out.lo), np.int64(n))
        kernels[op, name, "combine"](grid, block, pointers, stream=stream)
        if final and op is ReduceOp.AVG and reduction.participants > 1:
            divisor = np.int64(reduction.participants)
            kernels[op, name, "divide"](grid, block, (np.uint64(out.lo), np.int64(n), divisor), stream=stream)

    def oneshot_async(
        self, reduction: Reduction, outs: Sequence[Span], inputs: Sequence[Span], stream: cupy.cuda.Stream
    ) -> None:
        """One launch of cuda_kernels' one-shot kernel on ``stream``: the pointers by value
        (unused ones null), the count, and avg's divisor (0: no division). Inputs of other
        devices are read through peer access (enabled by DeviceContext.enable_peers; IPC
        mappings opened with cudaIpcMemLazyEnablePeerAccess)."""
        device = stream.lpsync_device
        why = oneshot_refusal(outs, inputs, reduction.dtype, device, self.topology)
        if why is None and any((device, s.device) in self.peer_refused for s in inputs):
            why = f"peer access from device {device} was refused (too many peers)"
        if why is not None:
            raise InvalidArgumentError(why)
        n = inputs[0].count
        if not n:
            return
        kernels = self._kernels_on(device)
        _use(device)
        m = cuda_kernels.ONESHOT_MAX
        pointers = [np.uint64(s.lo) for s in inputs] + [np.uint64(0)] * (m - len(inputs))
        pointers += [np.uint64(s.lo) for s in outs] + [np.uint64(0)] * (m - len(outs))
        divisor = reduction.participants if reduction.op is ReduceOp.AVG else 0
        args = (*pointers, np.int32(len(inputs)), np.int32(len(outs)), np.int64(n), np.int64(divisor))
        grid, block = (min(4096, (n + 255) // 256),), (256,)
        kernels[reduction.op, reduction.dtype.name, "oneshot"](grid, block, args, stream=stream)

    def enable_peer_access(self, device: int, peer: int) -> bool:
        _use(device)
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as error:
            status = getattr(error, "status", None)
            if status == _TOO_MANY_PEERS:
                self.peer_refused.add((device, peer))
                return False  # DeviceContext stages this pair through host memory
            if status != _PEER_ALREADY_ENABLED:
                raise
        return True

    def close_kind(self) -> None:
        with self._lock:
            waiters = list(self.waiters.values())
            self.waiters.clear()
        for waiter in waiters:
            waiter.stop()
        self.releaser.stop()


def _topology(count: int) -> Topology:
    nvlink = _nvlink_pairs(count)
    links = []
    for a in range(count):
        row = []
        for b in range(count):
            if a == b:
                row.append(Link.SAME)
            elif (a, b) in nvlink:
                row.append(Link.FAST)
            elif runtime.deviceCanAccessPeer(a, b):
                row.append(Link.SLOW)
            else:
                row.append(Link.HOST)
        links.append(tuple(row))
    return Topology(tuple(links))


def _nvlink_pairs(count: int) -> set[tuple[int, int]]:
    """CUDA ordinal pairs joined by NVLink, matched to NVML's devices by PCI bus id (the
    two number GPUs differently unless CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    try:
        import pynvml
    except ImportError:
        return set()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return set()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(runtime.deviceGetPCIBusId(i)) for i in range(count)]
        return {
            (a, b)
            for a in range(count)
            for b in range(count)
            if a != b
            and pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            == pynvml.NVML_P2P_STATUS_OK
        }
    except pynvml.NVMLError:
        return set()
    finally:
        pynvml.nvmlShutdown()
