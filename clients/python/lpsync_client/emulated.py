"""Emulated device arrays: what tests register in place of cupy arrays.

A daemon started with ``--devices emulated:N`` serves N host-emulated devices
(lpsync.memory.emulated). This module is the client's side of them, shaped like a GPU
framework: an ``Allocation`` is device memory (a memfd, so nothing is left in /dev/shm
if the process is killed) that may hold several arrays (as a caching allocator's segment
does), an ``EmulatedArray`` is a typed 1-D span of one, and every device has a current
``Stream`` — a worker thread that runs queued writes in order — that a collective is
ordered after, as a cupy array's collective is ordered after cupy's current stream.

    from lpsync_client import emulated
    x = emulated.asarray(np.ones(1024, np.float32), device=1)
    x.set_async(values, delay=0.2)     # queued on device 1's current stream
    client.allreduce(x)                # waits for the write above, then reduces
    x.get()                            # a numpy copy of the result

Framework tensors in emulated memory stand in for CUDA tensors where the framework has no
such device (torch and JAX run on the CPU here): ``tensor(count, torch.float32, device)``
is a torch CPU tensor over a fresh allocation, and ``find`` names the allocation that
holds an address, so the client and the adapters see such a tensor (or a JAX array
imported from that memory through DLPack) as device memory and register it by IPC handle.

The IPC handle is the exporter's (pid, fd, inode, size, device): the daemon opens
/proc/<pid>/fd/<fd>, so it opens only while this process is alive, like a CUDA handle.

Freeing an allocation while a daemon still maps it is cudaFree before the daemon's
cudaIpcCloseMemHandle: undefined behaviour on CUDA. Here it is detected (the daemon holds
a shared flock on the memfd while mapped; ``free`` tries for an exclusive one) and
reported: a RuntimeWarning, an entry in ``freed_while_mapped``, and the daemon refuses
the next collective on that mapping.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lpsync_client import futex
from lpsync_client._convert import dtype_name, numpy_dtype
from lpsync_client._ready import ReadyEvents
from lpsync_client.errors import InvalidArgumentError
from lpsync_client.wire import EMULATED_EVENT_HANDLE as EVENT_HANDLE
from lpsync_client.wire import EMULATED_EVENT_MAGIC as EVENT_MAGIC
from lpsync_client.wire import EMULATED_HANDLE as HANDLE
from lpsync_client.wire import EMULATED_MAGIC as MAGIC
from lpsync_client.wire import emulated_uuid, with_device_uuid

if TYPE_CHECKING:
    import torch

NOT_EXPORTABLE = (
    "this allocation cannot be exported through CUDA IPC (memory from cudaMallocAsync pools, "
    "expandable segments or managed memory): use torch without "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cupy's default MemoryPool rather than "
    "MemoryAsyncPool, or register a host buffer"
)


freed_while_mapped: list[str] = []  # what free() found mapped by another process (tests read it)


def visible_devices() -> list[int] | None:
    """The emulated CUDA_VISIBLE_DEVICES: LPSYNC_EMULATED_VISIBLE_DEVICES="2,0" makes this
    process's device 0 the daemon's device 2 (read when a device is named, not at import)."""
    value = os.environ.get("LPSYNC_EMULATED_VISIBLE_DEVICES", "").strip()
    return [int(x) for x in value.split(",")] if value else None


def physical_device(device: int) -> int:
    """The daemon's number of this process's device ``device``."""
    visible = visible_devices()
    if visible is None:
        return device
    if not 0 <= device < len(visible):
        raise InvalidArgumentError(f"device {device} is not visible (LPSYNC_EMULATED_VISIBLE_DEVICES)")
    return visible[device]


# Live allocations by the address of their first byte: what ``find`` looks up.
_live: dict[int, weakref.ref[Allocation]] = {}
_starts: list[int] = []  # the keys of _live, sorted
_live_lock = threading.Lock()


def in_use() -> bool:
    """Whether this process holds emulated memory (else no address is worth looking up)."""
    return bool(_starts)


def find(address: int, nbytes: int) -> tuple[Allocation, int] | None:
    """The live allocation holding ``nbytes`` at ``address`` and their offset in it; None
    for memory that is not emulated device memory (a dict probe when there is none)."""
    if not _starts:
        return None
    with _live_lock:
        i = bisect.bisect_right(_starts, address) - 1
        ref = _live[_starts[i]] if i >= 0 else None
    allocation = ref() if ref is not None else None
    if allocation is None or address + nbytes > allocation.address + allocation.nbytes:
        return None
    return allocation, address - allocation.address


class Allocation:
    """``nbytes`` of device memory on ``device`` (this process's ordinal); freed by
    ``free`` or when collected. ``exportable=False`` stands for memory CUDA IPC cannot
    export (cudaMallocAsync pools, expandable segments, managed memory)."""

    def __init__(self, nbytes: int, device: int = 0, exportable: bool = True) -> None:
        if nbytes < 0:
            raise InvalidArgumentError(f"cannot allocate {nbytes} bytes")
        self.nbytes, self.device, self.exportable = nbytes, device, exportable
        self.physical = physical_device(device)
        self._fd = os.memfd_create(f"lpsync-client-emu{device}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            self._mmap = mmap.mmap(self._fd, nbytes) if nbytes else None
        except BaseException:
            os.close(self._fd)
            raise
        self.bytes = (
            np.frombuffer(self._mmap, np.uint8, nbytes) if self._mmap is not None else np.empty(0, np.uint8)
        )
        self._inode = os.fstat(self._fd).st_ino
        self.address = self.bytes.ctypes.data if nbytes else 0
        if nbytes:
            with _live_lock:
                _live[self.address] = weakref.ref(self)
                bisect.insort(_starts, self.address)

    def ipc_handle(self) -> bytes:
        if self._fd < 0:
            raise InvalidArgumentError("the allocation was freed")
        if not self.exportable:
            raise InvalidArgumentError(NOT_EXPORTABLE)
        handle = HANDLE.pack(MAGIC, os.getpid(), self._fd, self._inode, self.nbytes, self.physical)
        return with_device_uuid(handle, emulated_uuid(self.physical))

    def array(self, offset: int, count: int, dtype: str | np.dtype) -> EmulatedArray:
        """A typed span of this allocation (a sub-allocation, as a caching allocator hands out)."""
        return EmulatedArray(self, offset, count, dtype)

    def mapped_elsewhere(self) -> bool:
        """Whether another process (a daemon) maps this allocation now."""
        if self._fd < 0:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def free(self) -> None:
        """Give the memory back. A daemon that still maps it keeps its mapping, but that is
        undefined behaviour on CUDA: reported (module docstring)."""
        if self.mapped_elsewhere():
            what = f"{self.nbytes} bytes on emulated:{self.device} freed while a daemon maps them"
            freed_while_mapped.append(what)
            warnings.warn(
                f"{what} (cudaFree before the registration's release: undefined behaviour on CUDA)",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.address:
            with _live_lock:
                if _live.pop(self.address, None) is not None:
                    _starts.remove(self.address)
            self.address = 0
        self.bytes = np.empty(0, np.uint8)
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.free()


class Event:
    def __init__(self) -> None:
        self._done = threading.Event()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("the emulated stream did not reach the event in time")

    def query(self) -> bool:
        return self._done.is_set()


class IpcEvent:
    """An interprocess event, as cupy's Event(interprocess=True): its handle opens in the
    daemon, whose streams then wait for the latest record made before their wait.

    The record is 8 bytes of a memfd: u32 records made, u32 records completed. ``record``
    counts one up and queues on the stream the store of its number into the completed
    word plus a futex wake, so a waiter in another process sleeps until then (no polling).
    """

    def __init__(self) -> None:
        self._fd = os.memfd_create("lpsync-event", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, 8)
        self._mmap = mmap.mmap(self._fd, 8)
        self._words = np.frombuffer(self._mmap, np.uint32, 2)
        self._inode = os.fstat(self._fd).st_ino
        self._lock = threading.Lock()
        self.handle = EVENT_HANDLE.pack(EVENT_MAGIC, os.getpid(), self._fd, self._inode)

    def record(self, stream: Stream) -> None:
        with self._lock:
            self._words[0] += 1
            generation = int(self._words[0])
        stream.enqueue(lambda: self._complete(generation))

    def _complete(self, generation: int) -> None:
        self._words[1] = generation
        futex.wake(self._words.__array_interface__["data"][0] + 4)

    @property
    def recorded(self) -> int:
        return int(self._words[0])

    @property
    def completed(self) -> int:
        return int(self._words[1])

    def idle(self) -> bool:
        """Its last record completed (cudaEventQuery): it may be recorded again."""
        return self.completed == self.recorded


class OpenedEvent:
    """The daemon's "done" event opened in this process (cudaIpcOpenEventHandle's
    stand-in): its 8-byte record (u32 records made, u32 records completed) mapped from
    the daemon's memfd. ``wait(stream)`` is cudaStreamWaitEvent: later work on ``stream``
    waits for the latest record made before the call (none: no wait at all), sleeping on
    the futex of the completed word. A daemon that exits first leaves the wait abandoned
    (recorded in ``abandoned_waits``) rather than the stream stuck for ever."""

    def __init__(self, handle: bytes) -> None:
        try:
            magic, pid, fd, inode = EVENT_HANDLE.unpack(handle)
        except Exception:
            raise InvalidArgumentError(f"not an emulated-device event handle ({len(handle)} bytes)") from None
        if magic != EVENT_MAGIC:
            raise InvalidArgumentError("not an emulated-device event handle (bad magic)")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:lpsync-event"):
                raise InvalidArgumentError("the handle does not name an emulated-device event")
            opened = os.open(path, os.O_RDWR)
        except OSError as error:
            raise InvalidArgumentError(f"cannot open the daemon's event: {error}") from None
        try:
            if os.fstat(opened).st_ino != inode:
                raise InvalidArgumentError("the daemon no longer holds that event")
            self._mmap = mmap.mmap(opened, 8)
        finally:
            os.close(opened)
        self._words = np.frombuffer(self._mmap, np.uint32, 2)
        self.pid = pid

    def reached(self, generation: int) -> bool:
        return (int(self._words[1]) - generation) & 0xFFFFFFFF < 0x80000000

    def wait(self, stream: Stream) -> None:
        generation = int(self._words[0])  # the latest record now, as cudaStreamWaitEvent
        if generation == 0:
            return
        address = self._words.__array_interface__["data"][0] + 4

        def waiter() -> None:
            while not self.reached(generation):
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    abandoned_waits.append(f"daemon {self.pid} exited before its event completed")
                    return
                futex.wait(address, int(self._words[1]), 1.0)

        stream.enqueue(waiter)


abandoned_waits: list[str] = []  # stream waits on a daemon's event that could never complete
_opened: dict[bytes, OpenedEvent] = {}
_opened_lock = threading.Lock()


def wait_event(handle: bytes, device: int = 0) -> None:
    """Make ``device``'s current stream wait for the daemon's event ``handle`` (opened
    once per handle: the daemon's events are pooled, so the same handles come back)."""
    with _opened_lock:
        event = _opened.get(handle)
        if event is None:
            if len(_opened) >= 256:  # the daemon's pools are smaller: a stale set
                _opened.clear()
            event = _opened[handle] = OpenedEvent(handle)
    event.wait(current_stream(device))


_ready_events: ReadyEvents[IpcEvent] = ReadyEvents()


def _new_event() -> tuple[IpcEvent, bytes]:
    event = IpcEvent()
    return event, event.handle


def ready_event(device: int = 0) -> IpcEvent:
    """An interprocess event of ``device``'s current stream that is free to record: one
    per outstanding collective (lpsync_client._ready)."""
    stream = current_stream(device)
    return _ready_events.take((device, id(stream)), _new_event, IpcEvent.idle)[0]


class Stream:
    """Queued operations run in order on a worker thread (blocking on its queue)."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._work, daemon=True, name=f"lpsync-client-emu-stream-{device}"
        )
        self._thread.start()

    def _work(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            op()

    def enqueue(self, op: Callable[[], None]) -> None:
        self._queue.put(op)

    def record(self) -> Event:
        event = Event()
        self.enqueue(event._done.set)
        return event

    def synchronize(self, timeout: float | None = None) -> None:
        self.record().synchronize(timeout)


_streams: dict[int, Stream] = {}
_streams_lock = threading.Lock()


def current_stream(device: int = 0) -> Stream:
    """The device's current stream (one per device per process, made on first use)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = Stream(device)
        return stream


@dataclass(frozen=True)
class DeviceArrayInfo:
    """What the client registers: lpsync_client._device reads this protocol."""

    kind: str
    device: int
    handle: bytes
    allocation_bytes: int
    offset: int
    nbytes: int
    count: int
    dtype: str


class EmulatedArray:
    """``count`` elements of ``dtype`` at ``offset`` of an Allocation (1-D, contiguous)."""

    def __init__(self, allocation: Allocation, offset: int, count: int, dtype: str | np.dtype) -> None:
        name = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
        self.dtype_name, self.dtype = name, numpy_dtype(name)
        if (
            offset < 0
            or offset % self.dtype.itemsize
            or offset + count * self.dtype.itemsize > allocation.nbytes
        ):
            raise InvalidArgumentError(f"{count} x {name} at {offset} does not fit the allocation")
        self.allocation, self.offset, self.size = allocation, offset, count
        self.nbytes = count * self.dtype.itemsize

    @property
    def device(self) -> int:
        return self.allocation.device

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def host(self) -> np.ndarray:
        """The memory itself, without stream ordering (tests use it to look underneath)."""
        return self.allocation.bytes[self.offset : self.offset + self.nbytes].view(self.dtype)

    def __getitem__(self, item: slice) -> EmulatedArray:
        start, stop, step = item.indices(self.size)
        if step != 1:
            raise InvalidArgumentError("emulated arrays slice contiguously")
        return EmulatedArray(
            self.allocation, self.offset + start * self.dtype.itemsize, max(0, stop - start), self.dtype_name
        )

    def get(self, timeout: float = 60.0) -> np.ndarray:
        """A numpy copy, after the current stream's queued work (like cupy's .get())."""
        current_stream(self.device).synchronize(timeout)
        return self.host.copy()

    def set(self, values: object, timeout: float = 60.0) -> None:
        current_stream(self.device).synchronize(timeout)
        self.host[...] = np.asarray(values).astype(self.dtype, copy=False).reshape(-1)

    def set_async(self, values: object, delay: float = 0.0) -> None:
        """Queue a write on the current stream; ``delay`` seconds of "kernel" before it."""
        data = np.array(values, dtype=self.dtype).reshape(-1)

        def write() -> None:
            if delay:
                time.sleep(delay)
            self.host[...] = data

        current_stream(self.device).enqueue(write)

    def __lpsync_device__(self) -> DeviceArrayInfo:
        return DeviceArrayInfo(
            "emulated",
            self.device,
            self.allocation.ipc_handle(),
            self.allocation.nbytes,
            self.offset,
            self.nbytes,
            self.size,
            self.dtype_name,
        )

    def __lpsync_sync__(self) -> None:
        """Order the device's current stream before a collective on this array (host wait)."""
        current_stream(self.device).synchronize()

    def __lpsync_ready__(self) -> bytes:
        """Record the device's interprocess event on its current stream; its handle, for the
        daemon's streams to wait on (no host wait)."""
        event = ready_event(self.device)
        event.record(current_stream(self.device))
        return event.handle

    def __lpsync_wait__(self, handle: bytes) -> None:
        """Order the device's current stream after the daemon's done event (a
        stream-ordered collective's answer): cudaStreamWaitEvent's stand-in."""
        wait_event(handle, self.device)

    def __repr__(self) -> str:
        return f"EmulatedArray({self.size} x {self.dtype_name} on emulated:{self.device})"


def empty(count: int, dtype: str | np.dtype = "float32", device: int = 0) -> EmulatedArray:
    name = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
    return Allocation(count * numpy_dtype(name).itemsize, device).array(0, count, name)


def zeros(count: int, dtype: str | np.dtype = "float32", device: int = 0) -> EmulatedArray:
    array = empty(count, dtype, device)
    array.host.fill(0)
    return array


def asarray(values: np.ndarray, device: int = 0, dtype: str | None = None) -> EmulatedArray:
    source = np.asarray(values).reshape(-1)
    array = empty(source.size, dtype or dtype_name(source.dtype), device)
    array.host[...] = source
    return array


class _Held(np.ndarray):
    """A numpy view of emulated memory that keeps its Allocation alive: torch.from_numpy
    and DLPack keep the view, so a framework tensor made from it keeps the memory."""

    allocation: Allocation


def held_view(array: EmulatedArray) -> np.ndarray:
    """``array``'s bytes (uint8) as a numpy view that keeps its allocation alive."""
    view = array.allocation.bytes[array.offset : array.offset + array.nbytes].view(_Held)
    view.allocation = array.allocation
    return view


def tensor(count: int, dtype: torch.dtype, device: int = 0) -> torch.Tensor:
    """A torch tensor of ``count`` elements in fresh emulated memory of ``device``:
    uninitialised, as torch.empty on a GPU (any torch dtype, bool included)."""
    import torch

    raw = empty(count * dtype.itemsize, "uint8", device)
    return torch.from_numpy(held_view(raw)).view(dtype)
