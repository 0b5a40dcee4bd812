"""Operand resolution: what a collective's ``x`` and ``out`` are to the daemon.

A host array in one of this client's shared-memory segments (``empty``, ``zeros``) is
named by handle and offset, zero copy; a ``register``-ed host tensor is staged through its
own segment (copied in before a collective that reads it, back after one that writes it);
any other host array is staged through a pooled scratch segment; a device array (cupy,
torch CUDA, JAX GPU, the emulated device) is opened by the daemon through IPC and used in
place, registered on first use. ``Buffers`` is the part of Client that keeps these
registrations (segments, device spans, scratch pool, the reaper of weakly held ones).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from lpsync_client._convert import as_numpy, numpy_dtype
from lpsync_client._device import DeviceOperand, describe, is_device_array
from lpsync_client._shm import Mapping
from lpsync_client.emulated import DeviceArrayInfo
from lpsync_client.errors import InvalidArgumentError, LpsyncError, from_rpc_error
from lpsync_client.wire.proto import lpsync_pb2 as pb

_SCRATCH_KEEP = 8  # staging segments kept for reuse by unregistered arrays


@dataclass
class Segment:
    handle: int
    mapping: Mapping


class Registered:
    """A tensor of yours staged through a daemon segment: copied in before each collective
    that reads it, copied back after each that writes it. Made by Client.register()."""

    def __init__(
        self, client: Buffers, source: np.ndarray, dtype: str, segment: Segment, original: object
    ) -> None:
        self.client, self.source, self.dtype, self.original = client, source, dtype, original
        self.segment = segment
        self.staging = segment.mapping.array[: source.nbytes].view(source.dtype)

    @property
    def handle(self) -> int:
        return self.segment.handle

    def release(self) -> None:
        self.client.release(self)


class DeviceRegistered:
    """A span of device memory the daemon has opened (through CUDA IPC, or the emulated
    device's equivalent); collectives on it run on the daemon's streams, no copies. Holds
    the user's array, so the allocation stays alive while registered. Made by
    Client.register() (or on first use of an unregistered device array)."""

    def __init__(self, client: Buffers, operand: DeviceOperand, handle: int, hold: bool = True) -> None:
        self.client, self.handle, self.info = client, handle, operand.info
        # hold=False (the framework adapters): the array is not kept alive; a finalizer
        # releases this registration once it is collected (Client.register). Its memory
        # is (the storage, not the array): the daemon maps it until the release, and
        # CUDA leaves a cudaFree before the daemon's cudaIpcCloseMemHandle undefined.
        self.operand: DeviceOperand | None = operand if hold else None
        self.original = operand.keep if hold else None
        self.sync = operand.sync if hold else None  # (a bound method would hold the array)
        self.memory = operand.memory

    @property
    def size(self) -> int:
        return self.info.count

    def covers(self, info: DeviceArrayInfo) -> bool:
        mine = self.info
        return (
            (mine.kind, mine.device, mine.handle) == (info.kind, info.device, info.handle)
            and mine.offset <= info.offset
            and info.offset + info.nbytes <= mine.offset + mine.nbytes
        )

    def release(self) -> None:
        self.client.release(self)


@dataclass
class Sized:
    size: int


@dataclass
class Operand:
    ref: pb.BufferRef
    array: np.ndarray | Sized  # the 1-D typed view the daemon reads/writes; its size
    dtype: str
    copy_in: tuple[np.ndarray, np.ndarray] | None = None  # (staging, source) pairs to copy before / after
    copy_out: tuple[np.ndarray, np.ndarray] | None = None
    scratch: Segment | None = None
    device: DeviceOperand | None = None  # a device array: its stream is ordered in _submit
    # A stream-ordered call's: makes the submitter's stream wait on the done event.
    wait_done: Callable[[bytes], None] | None = None


def _release_later(client_ref: weakref.ref, handle: int) -> None:
    """A hold=False registration's array was collected: queue its release (Client._reap)."""
    client = client_ref()
    if client is not None:
        client._dead.put(handle)


def _reap_forever(dead: queue.SimpleQueue, client_ref: weakref.ref) -> None:
    """The reaper thread: releases hold=False registrations as their arrays go, so their
    memory returns to the allocator within one Release call of the array's death (a
    gradient dropped by zero_grad(set_to_none=True) is not held into the next backward).
    A threading.Event in the queue is set once everything queued before it is released."""
    while True:
        item = dead.get()
        if item is None:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        client = client_ref()
        if client is None:
            return
        with contextlib.suppress(Exception):  # a closed channel: the session's end frees it
            client._release_dead(item)
        del client


def order_streams(request: pb.CollectiveRequest, operands: list[Operand]) -> None:
    """Device buffers: the input's current stream is ordered by an interprocess event the
    daemon's streams wait on (no host wait); an output on another device (or without IPC
    events) waits on the host. Where every operand is on the input's device and its
    framework can wait on the daemon's event, the request asks for a stream-ordered
    answer (unless the client's ``device_host_wait``: Client._submit)."""
    first = operands[0].device
    assert first is not None
    request.ready_event = first.order()
    together = True
    for other in operands[1:]:
        d = other.device
        if d is not None and not (
            request.ready_event
            and d.ready is not None
            and d.info.kind == first.info.kind
            and d.info.device == first.info.device
        ):
            d.sync()
            together = False
    waiter = first.done_waiter
    request.stream_ordered = bool(request.ready_event and together and waiter is not None)
    if waiter is not None and request.stream_ordered:  # bound here: the submitter's stream
        operands[0].wait_done = waiter()


def after_answer(operands: list[Operand], response: pb.CollectiveResponse) -> None:
    """A stream-ordered answer: the input's current stream waits on the daemon's done
    event (the work was enqueued, not finished), so what the client queues next sees the
    result; anything that reads it on the host synchronizes that stream first."""
    if response.done_event and operands and operands[0].wait_done is not None:
        operands[0].wait_done(response.done_event)


class Buffers:
    """Client's buffers and registrations (its state is Client's, set in its __init__)."""

    # Device collectives: False, the default, answers once the work is enqueued on the
    # daemon's streams and orders the caller's current stream after it (a done event,
    # issue 47 item 1); True answers once the work finished (a host wait in the daemon).
    device_host_wait: bool = False

    session_id: str
    timeout: float
    _stub: Any  # the generated LpSyncStub
    _metadata: tuple[tuple[str, str], ...] | None
    _lock: threading.Lock
    _closed: bool
    _segments: dict[int, Segment]
    _device: dict[int, DeviceRegistered]  # device registrations by handle
    # Handles of hold=False registrations whose array died (a finalizer may run inside
    # any locked region of this thread: a queue, not self._lock).
    _dead: queue.SimpleQueue[int | threading.Event | None]
    _reaper: threading.Thread | None  # started by the first hold=False registration
    _scratch: dict[int, list[Segment]]
    # The hot path's prepared requests (_hot.py): forgotten when a segment goes, since an
    # address may come back in another one.
    _prepared: dict[tuple, Any]
    _armed: dict[tuple, Any]

    def _call(self, method, request, timeout: float | None = 30.0):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def _map(self, buffer: pb.Buffer) -> Segment:
        segment = Segment(buffer.handle, Mapping(buffer.shm_name, buffer.nbytes))
        with self._lock:
            self._segments[buffer.handle] = segment
        return segment

    def _find(self, array: np.ndarray) -> tuple[Segment, int] | None:
        address = array.__array_interface__["data"][0]
        with self._lock:
            for segment in self._segments.values():
                if segment.mapping.contains(address, array.nbytes):
                    return segment, address - segment.mapping.base
        return None

    # -- buffers ---------------------------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: str | np.dtype = "float32") -> np.ndarray:
        """An uninitialised array in shared memory the daemon maps too (zero copy).

        >>> grads = client.empty((1024, 1024), "float32")
        """
        dt = numpy_dtype(np.dtype(dtype).name if not isinstance(dtype, str) else dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        segment = self._map(
            self._call(self._stub.Allocate, pb.AllocateRequest(session_id=self.session_id, nbytes=nbytes))
        )
        return segment.mapping.array[:nbytes].view(dt).reshape(shape)

    def zeros(self, shape: int | Sequence[int], dtype: str | np.dtype = "float32") -> np.ndarray:
        """Like :meth:`empty`, filled with zeros."""
        array = self.empty(shape, dtype)
        array.fill(0)
        return array

    def register(self, x: object, *, hold: bool = True) -> Registered | DeviceRegistered:
        """Stage ``x`` (numpy array, torch CPU tensor, __dlpack__ or buffer-protocol object)
        through shared memory; pass the result to collectives instead of ``x``.

        Device memory (cupy, torch CUDA, JAX GPU, lpsync_client.emulated) is not staged: the
        daemon opens the allocation through IPC and works on it in place; collectives then
        take the array itself or the returned handle.

        >>> h = client.register(torch.zeros(10))
        >>> client.allreduce(h)          # h.original now holds the sum
        """
        if is_device_array(x):
            self._reap()
            operand = describe(x)
            registered = self._register_device(operand, hold)
            if not hold:
                try:
                    if operand.memory is None:  # its memory cannot be held apart from it
                        raise TypeError
                    weakref.finalize(x, _release_later, weakref.ref(self), registered.handle)
                except TypeError:  # held: released with the client (or by the adapter)
                    registered.operand, registered.original = operand, x
                else:
                    self._start_reaper()
            return registered
        source, dtype = as_numpy(x)
        buffer = self._call(
            self._stub.Register,
            pb.RegisterRequest(session_id=self.session_id, nbytes=source.nbytes, device="cpu"),
        )
        return Registered(self, source, dtype, self._map(buffer), x)

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None or self._closed:
                return
            self._reaper = threading.Thread(
                target=_reap_forever,
                args=(self._dead, weakref.ref(self)),
                name="lpsync-client-reaper",
                daemon=True,
            )
        self._reaper.start()

    def _reap(self, wait: bool = False) -> None:
        """Release the registrations whose arrays were collected (queued by finalizers,
        which must not call the daemon from whatever thread the GC runs in): the reaper
        thread does once started (``wait``: until what is queued now is released), else
        this thread. Each holds its memory until released: it goes back to the allocator
        only once the daemon answered the release, having closed its mapping."""
        if self._reaper is not None:
            if wait and self._reaper.is_alive():
                flushed = threading.Event()
                self._dead.put(flushed)
                flushed.wait(self.timeout)
            return
        dead = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._dead.get_nowait()
                if isinstance(item, int):
                    dead.append(item)
        for handle in dead:
            self._release_dead(handle)

    def _release_dead(self, handle: int) -> None:
        with self._lock:
            if self._closed:  # close() detaches, then drops every registration and its memory
                return
            registered = self._device.pop(handle, None)
        if registered is not None:
            with contextlib.suppress(LpsyncError):
                self._call(self._stub.Release, pb.ReleaseRequest(session_id=self.session_id, handle=handle))
        del registered  # its memory goes now: the daemon has closed its mapping

    def device_registrations(self) -> int:
        """Device spans registered now (after releasing those of collected arrays)."""
        self._reap(wait=True)
        with self._lock:
            return len(self._device)

    def ensure_registered(self, x: object) -> DeviceRegistered | None:
        """Register device array ``x``'s span unless a registration covers it already
        (hold=False: released once the array is collected). Returns a registration the
        caller must release after its collective: one that had to hold the array (not
        weakly referenceable), which would otherwise live as long as the client."""
        self._reap()
        info = describe(x).info
        with self._lock:
            covered = any(r.covers(info) for r in self._device.values())
        if covered:
            return None
        registered = self.register(x, hold=False)
        assert isinstance(registered, DeviceRegistered)
        return registered if registered.original is not None else None

    def _register_device(self, operand: DeviceOperand, hold: bool = True) -> DeviceRegistered:
        info = operand.info
        buffer = self._call(
            self._stub.Register,
            pb.RegisterRequest(
                session_id=self.session_id,
                nbytes=info.nbytes,
                device=info.kind,
                device_index=info.device,
                ipc_handle=info.handle,
                ipc_offset=info.offset,
                allocation_bytes=info.allocation_bytes,
            ),
        )
        registered = DeviceRegistered(self, operand, buffer.handle, hold)
        with self._lock:
            self._device[buffer.handle] = registered
        return registered

    def _device_operand(self, x: object) -> Operand:
        if isinstance(x, DeviceRegistered):
            if x.operand is None:
                raise InvalidArgumentError(
                    "this registration does not hold its array (register(hold=False)): pass the array itself"
                )
            return Operand(pb.BufferRef(handle=x.handle), Sized(x.info.count), x.info.dtype, device=x.operand)
        operand = describe(x)
        info = operand.info
        with self._lock:
            found = next((r for r in self._device.values() if r.covers(info)), None)
        if found is None:  # first use: registered for good (release(x) gives it back)
            found = self._register_device(operand)
        return Operand(
            pb.BufferRef(handle=found.handle, offset=info.offset - found.info.offset),
            Sized(info.count),
            info.dtype,
            device=operand,
        )

    def release(self, x: object) -> None:
        """Give a buffer from empty()/zeros()/register() back to the daemon."""
        if isinstance(x, DeviceRegistered) or (
            not isinstance(x, Registered | np.ndarray) and is_device_array(x)
        ):
            if not isinstance(x, DeviceRegistered):
                info = describe(x).info
                with self._lock:
                    x = next((r for r in self._device.values() if r.covers(info)), None)
                if x is None:
                    raise InvalidArgumentError("this device array is not registered")
            self._call(self._stub.Release, pb.ReleaseRequest(session_id=self.session_id, handle=x.handle))
            with self._lock:
                self._device.pop(x.handle, None)
            return
        if isinstance(x, Registered):
            segment = x.segment
        else:
            found = self._find(np.asarray(x))
            if found is None:
                raise InvalidArgumentError("this array is not in a buffer of this client")
            segment = found[0]
        self._call(self._stub.Release, pb.ReleaseRequest(session_id=self.session_id, handle=segment.handle))
        with self._lock:
            self._segments.pop(segment.handle, None)
            self._prepared.clear()  # an address may come back in another segment
            self._armed.clear()
        segment.mapping.close()

    def _operand(self, x: object, writes: bool) -> Operand:
        if isinstance(x, DeviceRegistered) or (type(x) is not np.ndarray and is_device_array(x)):
            return self._device_operand(x)
        if isinstance(x, Registered):
            return Operand(
                pb.BufferRef(handle=x.handle),
                x.staging.reshape(-1),
                x.dtype,
                (x.staging, x.source),
                (x.staging, x.source) if writes else None,
            )
        array, dtype = as_numpy(x)
        found = self._find(array)
        if found is not None:
            segment, offset = found
            return Operand(pb.BufferRef(handle=segment.handle, offset=offset), array, dtype)
        scratch = self._take_scratch(array.nbytes)
        staging = scratch.mapping.array[: array.nbytes].view(array.dtype)
        return Operand(
            pb.BufferRef(handle=scratch.handle),
            staging,
            dtype,
            (staging, array),
            (staging, array) if writes else None,
            scratch,
        )

    def _take_scratch(self, nbytes: int) -> Segment:
        with self._lock:
            pool = self._scratch.get(nbytes)
            if pool:
                return pool.pop()
        return self._map(
            self._call(
                self._stub.Register,
                pb.RegisterRequest(session_id=self.session_id, nbytes=nbytes, device="cpu"),
            )
        )

    def _give_scratch(self, segment: Segment) -> None:
        with self._lock:
            pool = self._scratch.setdefault(segment.mapping.nbytes, [])
            if sum(len(p) for p in self._scratch.values()) < _SCRATCH_KEEP:
                pool.append(segment)
                return
        # The session may be gone already; then the daemon has freed the segment.
        with contextlib.suppress(Exception):
            self.release_handle(segment.handle)

    def release_handle(self, handle: int) -> None:
        self._call(self._stub.Release, pb.ReleaseRequest(session_id=self.session_id, handle=handle))
        with self._lock:
            segment = self._segments.pop(handle, None)
            self._prepared.clear()
            self._armed.clear()
        if segment is not None:
            segment.mapping.close()

    def _recycle(self, operands: list[Operand]) -> None:
        for operand in operands:
            if operand.scratch is not None:
                self._give_scratch(operand.scratch)
