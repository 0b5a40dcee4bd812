"""What the executor's Plan does to its buffers, for host arrays and for device spans.

A Plan slices, sends, receives, copies and reduces; where its buffers live decides how:
  * HostBuffers (the default): numpy arrays, reduced by numpy on the calling thread;
  * DeviceBuffers: Spans of one device (lpsync.memory.kind), handed to the transport as
    the kind's wire view (a cupy array: UCX moves device memory itself) and copied and
    reduced on the device's stream. Used by the peer plane's direct device path
    (lpsync/daemon/collectives/hierarchy.py), where UCX is CUDA-aware;
  * BouncedBuffers: Spans of one device whose messages cross a host transport through a
    few pinned slots (the flat path of jobs that mix host and device buffers,
    lpsync/daemon/collectives/staging.py); copies and reductions stay on the device.

The transport reads and writes device memory outside the kind's streams, so a device
copy or reduction is complete (its event synchronized) before the Plan goes on: a send
never reads a chunk a kernel still writes, a receive never lands under a kernel still
reading its slot.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from typing import Any, Protocol

import numpy as np

from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import MemoryKind, Span
from lpsync.reduction import Reduction


class Buffers(Protocol):
    host: bool  # numpy arrays: the transport may also lend received bytes (recv_borrow)

    def fits(self, buf: Any, count: int) -> bool:
        """Whether ``buf`` is a contiguous 1-D buffer of ``count`` elements."""

    def address(self, buf: Any) -> tuple[int, int]:
        """The byte range ``buf`` covers (overlap checks)."""

    def scratch(self, key: object, nbytes: int) -> Any:
        """A uint8 buffer of at least ``nbytes`` (TMP, receive slots)."""

    def typed(self, buf: Any, nbytes: int, dtype: np.dtype) -> Any:
        """The first ``nbytes`` of uint8 ``buf`` as ``dtype`` elements."""

    def wire(self, buf: Any) -> Any:
        """``buf`` as the transport takes it."""

    def copy(self, dst: Any, src: Any, deadline: float) -> None: ...

    def combine(
        self, reduction: Reduction, acc: Any, incoming: Any, out: Any, final: bool, deadline: float
    ) -> None:
        """out = acc (op) incoming, then the avg division where ``final``."""


class HostBuffers:
    host = True

    def fits(self, buf: np.ndarray, count: int) -> bool:
        return buf.ndim == 1 and buf.flags.c_contiguous and buf.size == count

    def address(self, buf: np.ndarray) -> tuple[int, int]:
        start = buf.__array_interface__["data"][0]
        return start, start + buf.nbytes

    def scratch(self, key: object, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def typed(self, buf: np.ndarray, nbytes: int, dtype: np.dtype) -> np.ndarray:
        return buf[:nbytes].view(dtype)

    def wire(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def copy(self, dst: np.ndarray, src: np.ndarray, deadline: float) -> None:
        np.copyto(dst, src)

    def combine(
        self,
        reduction: Reduction,
        acc: np.ndarray,
        incoming: np.ndarray,
        out: np.ndarray,
        final: bool,
        deadline: float,
    ) -> None:
        reduction.combine(acc, incoming, out)
        if final:
            reduction.finalize(out)


HOST = HostBuffers()


class DeviceBuffers:
    """Spans of ``device``, worked on through ``kind`` on ``stream``; ``done`` is an event
    of that device, recorded after each operation and synchronized. Scratch is shared by
    key among the Plans that use one instance (they must run one at a time: the segments
    of one hierarchical collective) and kept until ``close``; it comes from ``pool`` (the
    daemon's staging pool, which keeps what it gets back within its bytes: no cudaMalloc
    per plan), or from the kind where none is given."""

    host = False

    def __init__(self, kind: MemoryKind, device: int, stream: Any, done: Any, pool: Any = None) -> None:
        self.kind, self.device, self.stream, self.done, self.pool = kind, device, stream, done, pool
        self._scratch: dict[object, Span] = {}
        self._held: list[Any] = []  # every allocation, freed by close

    def fits(self, buf: Span, count: int) -> bool:
        return isinstance(buf, Span) and buf.device == self.device and buf.count == count

    def address(self, buf: Span) -> tuple[int, int]:
        return buf.lo, buf.hi

    def scratch(self, key: object, nbytes: int) -> Span:
        span = self._scratch.get(key)
        if span is None or span.nbytes < nbytes:  # grown: Plans built earlier keep the old one
            if self.pool is not None:
                memory = self.pool.take(self.device, max(nbytes, 1))
            else:
                memory = self.kind.allocate(self.device, max(nbytes, 1))
            self._held.append(memory)
            span = self._scratch[key] = Span(memory, 0, nbytes, np.dtype(np.uint8))
        return span

    def typed(self, buf: Span, nbytes: int, dtype: np.dtype) -> Span:
        if nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{nbytes} bytes are not whole {dtype} elements")
        return Span(buf.memory, buf.offset, nbytes // dtype.itemsize, dtype)

    def wire(self, buf: Span) -> Any:
        return self.kind.wire(buf)

    def copy(self, dst: Span, src: Span, deadline: float) -> None:
        self.kind.copy_async(dst, src, self.stream)
        self._finish(deadline)

    def combine(
        self, reduction: Reduction, acc: Span, incoming: Span, out: Span, final: bool, deadline: float
    ) -> None:
        self.kind.reduce_async(reduction, out, acc, incoming, final, self.stream)
        self._finish(deadline)

    def _finish(self, deadline: float) -> None:
        self.kind.record(self.done, self.stream)
        self.kind.synchronize(self.done, deadline)

    def close(self) -> None:
        for memory in self._held:
            if self.pool is not None:
                self.pool.give(memory)
            else:
                self.kind.free(memory)
        self._held.clear()
        self._scratch.clear()


_BYTE = np.dtype(np.uint8)
SEND_SLOTS = 4  # pinned slots a participant's sends in flight hold at most


class HostBytes:
    """Host bytes as a kind's copy takes them (a Memory of device -1): bytes the
    transport lends (the inproc fabric hands over the sender's own)."""

    device = -1

    def __init__(self, array: np.ndarray) -> None:
        self.array = array.view(np.uint8).reshape(-1)
        self.nbytes = self.array.nbytes
        self.address = self.array.__array_interface__["data"][0]


def host_array(memory: Any, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of ``nbytes`` of a kind's host memory (pinned on CUDA)."""
    if not nbytes:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(memory.address))


class BouncedBuffers:
    """Spans of ``device`` whose messages cross a host transport through a few pinned
    host slots: a participant of the flat path (a multi-node job where some node passes
    host buffers, lpsync/daemon/collectives/staging.py) runs its program on its own
    device spans, and only what travels touches host memory:

      * a SEND copies its chunk into a send slot (D2H, synchronized) and sends the slot;
        SEND_SLOTS at most, one reused once its send completed;
      * a RECV lands in a receive slot (the Plan's receive window, posted ahead) or in
        the bytes a local peer lends, and is copied to its span (H2D, synchronized);
      * a RECV_REDUCE's incoming chunk goes to a device slot (H2D) and is reduced there
        on the device into the span;
      * COPY and TMP stay on the device.
    So host memory per participant is its receive window and send slots: half of
    ``budget`` each, in slots of the schedule's largest message (at least one of each,
    at most RECV_WINDOW and SEND_SLOTS), whatever the buffers' size (the first reading
    mirrored both buffers whole). Every copy and reduction is complete (its event
    synchronized) before the Plan goes on: the transport reads and writes the slots
    outside the kind's streams. Memory comes from ``pool`` (the daemon's staging pool)
    and goes back to it at ``close``.
    """

    host = False
    bounced = True  # the executor hands this the bytes that travel (executor.py)

    def __init__(
        self, kind: MemoryKind, device: int, stream: Any, done: Any, pool: Any, budget: int = 8 << 20
    ) -> None:
        self.kind, self.device, self.stream, self.done, self.pool = kind, device, stream, done, pool
        self.budget = budget
        self._held: list[Any] = []  # every pool memory, given back by close
        self._slots: dict[int, tuple[Any, np.ndarray]] = {}  # a host slot's address -> it
        self._sending: deque[tuple[Any, np.ndarray, Any]] = deque()  # (memory, view, request)
        self._free: list[tuple[Any, np.ndarray]] = []  # send slots whose sends completed
        self._device_slot: Span | None = None  # where an incoming chunk is reduced from
        self._scratch: dict[object, Any] = {}  # TMP and the receive window, by key

    # -- what the Plan asks of any Buffers ------------------------------------------------
    def fits(self, buf: Span, count: int) -> bool:
        return isinstance(buf, Span) and buf.device == self.device and buf.count == count

    def address(self, buf: Span) -> tuple[int, int]:
        return buf.lo, buf.hi

    def scratch(self, key: object, nbytes: int) -> Any:
        """TMP on the device; the receive window's slots in pinned host memory. Shared by
        key among the Plans over these buffers (one runs at a time); grown, a new one."""
        found = self._scratch.get(key)
        if found is not None and found.nbytes >= nbytes:
            return found
        if key == "tmp":
            found = Span(self._take(self.device, nbytes), 0, max(nbytes, 1), _BYTE)
        else:
            found = self._host_slot(nbytes)[1]
        self._scratch[key] = found
        return found

    def typed(self, buf: Any, nbytes: int, dtype: np.dtype) -> Any:
        if isinstance(buf, np.ndarray):
            return buf[:nbytes].view(dtype)
        if nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{nbytes} bytes are not whole {dtype} elements")
        return Span(buf.memory, buf.offset, nbytes // dtype.itemsize, dtype)

    def wire(self, buf: Any) -> Any:
        return buf  # never sent as is: ``outgoing`` stages it

    def copy(self, dst: Span, src: Span, deadline: float) -> None:
        self.kind.copy_async(dst, src, self.stream)
        self._finish(deadline)

    def combine(
        self, reduction: Reduction, acc: Span, incoming: Any, out: Span, final: bool, deadline: float
    ) -> None:
        """out = acc (op) incoming on the device; ``incoming`` is host bytes (a receive
        slot or a local peer's lent message): copied to the device slot first."""
        n = out.nbytes
        slot = self._device_slot
        if slot is None or slot.nbytes < n:
            slot = self._device_slot = Span(self._take(self.device, n), 0, n, _BYTE)
        on_device = Span(slot.memory, 0, out.count, out.dtype)
        self.kind.copy_async(Span(slot.memory, 0, n, _BYTE), self._host_span(incoming, n), self.stream)
        self.kind.reduce_async(reduction, out, acc, on_device, final, self.stream)
        self._finish(deadline)

    # -- what the executor asks of bounced buffers ---------------------------------------
    def window(self, nbytes: int, most: int) -> int:
        """How many receives of ``nbytes`` may be posted ahead (each holds a slot)."""
        return max(1, min(most, self.budget // 2 // max(nbytes, 1)))

    def outgoing(self, span: Any, deadline: float) -> np.ndarray:
        """``span``'s bytes in a send slot, landed: what the transport sends."""
        n = span.nbytes
        memory, array = self._send_slot(n, deadline)
        self.kind.copy_async(Span(memory, 0, n, _BYTE), Span(span.memory, span.offset, n, _BYTE), self.stream)
        self._finish(deadline)
        return array[:n]

    def sending(self, view: np.ndarray, request: Any) -> None:
        """The send of ``view`` (an ``outgoing`` slot) is under way: its slot is reused
        once ``request`` completed."""
        memory, array = self._slots[view.__array_interface__["data"][0]]
        self._sending.append((memory, array, request))

    def land(self, span: Any, data: np.ndarray, deadline: float) -> None:
        """span = the received bytes ``data`` (a receive slot, or lent bytes), landed."""
        n = span.nbytes
        self.kind.copy_async(Span(span.memory, span.offset, n, _BYTE), self._host_span(data, n), self.stream)
        self._finish(deadline)

    def close(self) -> None:
        """Give every slot back to the pool (no run is in flight: the plan's cache closes
        this once its runs ended)."""
        held, self._held = self._held, []
        self._slots.clear()
        self._sending.clear()
        self._free.clear()
        self._scratch.clear()
        self._device_slot = None
        for memory in held:
            self.pool.give(memory)

    # -- inside -------------------------------------------------------------------------------
    def _take(self, device: int, nbytes: int) -> Any:
        memory = self.pool.take(device, max(nbytes, 1), self.device)
        self._held.append(memory)
        return memory

    def _host_slot(self, nbytes: int) -> tuple[Any, np.ndarray]:
        memory = self._take(-1, nbytes)
        array = host_array(memory, memory.nbytes)
        self._slots[array.__array_interface__["data"][0]] = (memory, array)
        return memory, array

    def _send_slot(self, nbytes: int, deadline: float) -> tuple[Any, np.ndarray]:
        """A free send slot of ``nbytes`` at least: one whose send completed, a new one
        while fewer than SEND_SLOTS are out, else the oldest once its send completed."""
        while self._sending and self._sending[0][2].done():
            memory, array, _ = self._sending.popleft()
            self._free.append((memory, array))
        most = max(1, min(SEND_SLOTS, self.budget // 2 // max(nbytes, 1)))
        while not self._free and len(self._sending) >= most:
            memory, array, request = self._sending.popleft()
            request.wait(deadline)
            self._free.append((memory, array))
        for i, (memory, _) in enumerate(self._free):
            if memory.nbytes >= nbytes:
                return self._free.pop(i)
        if self._free:  # too small for this message: its memory goes back, a larger one comes
            memory, array = self._free.pop()
            self._slots.pop(array.__array_interface__["data"][0], None)
            self._held.remove(memory)
            self.pool.give(memory)
        return self._host_slot(nbytes)

    def _host_span(self, data: np.ndarray, nbytes: int) -> Span:
        """Host bytes as a span the kind copies from: a slot's own memory (pinned), else
        the bytes as they are (a transport's)."""
        slot = self._slots.get(data.__array_interface__["data"][0])
        return Span(slot[0] if slot is not None else HostBytes(data), 0, nbytes, _BYTE)

    def _finish(self, deadline: float) -> None:
        self.kind.record(self.done, self.stream)
        self.kind.synchronize(self.done, deadline)

    def drain(self, patience: float = 3600.0) -> None:
        """After a failed run: until what it left on the stream ran (errors ignored: the
        run reported its failure), then the stream's error cleared where the kind can."""
        with contextlib.suppress(Exception):
            self._finish(time.monotonic() + patience)
        recover = getattr(self.kind, "recover", None)
        if recover is not None:
            recover(self.stream)
