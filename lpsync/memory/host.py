"""The host memory kind: kind.py's operations table over host memory, synchronously.

One "device" (0): the host. Memory is a SharedSegment (shm.py) when allocated here, so it
can be exported by name and opened by another process, as the daemon's buffers are.
Streams run every operation inline, at enqueue: a plan's enqueue order (records before
the waits on them, writes after the consumption of what they overwrite) is then its
execution order, so events need no state and waits are no-ops. The daemon's host
collectives use the executor (engine/executor.py) over the inproc transport instead: its
zero-copy receives and the direct path are faster for host memory; this table lets the
device engine run on plain host memory (tests cross-check the two engines).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span, Topology
from lpsync.memory.shm import SharedSegment
from lpsync.reduction import Reduction


@dataclass(eq=False)
class HostMemory:
    device: int
    nbytes: int
    array: np.ndarray
    address: int
    segment: SharedSegment | None = None


def _memory(segment: SharedSegment | None, array: np.ndarray, device: int = 0) -> HostMemory:
    address = array.__array_interface__["data"][0] if array.nbytes else 0
    return HostMemory(device, array.nbytes, array, address, segment)


def _view(span: Span) -> np.ndarray:
    return span.memory.array[span.offset : span.offset + span.nbytes]


@dataclass(frozen=True)
class HostStream:
    device: int = 0


class HostKind:
    name = "host"
    devices = 1
    topology = Topology.uniform(1)

    def allocate(self, device: int, nbytes: int) -> HostMemory:
        if device != 0:
            raise InvalidArgumentError("host memory has one device, 0")
        segment = SharedSegment.create(nbytes)
        return _memory(segment, segment.array)

    def allocate_host(self, nbytes: int, device: int | None = None) -> HostMemory:
        return _memory(None, np.empty(nbytes, np.uint8), device=-1)

    def free(self, memory: HostMemory) -> None:
        if memory.segment is not None:
            memory.segment.unlink()
            memory.segment.close()

    def export(self, memory: HostMemory) -> bytes:
        if memory.segment is None:
            raise InvalidArgumentError("only shared-memory allocations can be exported")
        return f"{memory.segment.name}:{memory.nbytes}".encode()

    def open(self, handle: bytes, device: int) -> HostMemory:
        try:
            name, nbytes = handle.decode().rsplit(":", 1)
            size = int(nbytes)
        except ValueError:
            raise InvalidArgumentError("not a host memory handle") from None
        segment = SharedSegment.attach(name, size)
        return _memory(segment, segment.array)

    def close(self, memory: HostMemory) -> None:
        if memory.segment is not None:
            memory.segment.close()

    def wire(self, span: Span) -> np.ndarray:
        return _view(span)

    def read(self, span: Span) -> np.ndarray:
        return _view(span).view(span.dtype).copy()

    def write(self, span: Span, data: np.ndarray) -> None:
        np.copyto(_view(span), np.ascontiguousarray(data).view(np.uint8).reshape(-1))

    def uuid(self, device: int) -> bytes:
        return b""

    def stream(self, device: int) -> HostStream:
        return HostStream(device)

    def destroy_stream(self, stream: HostStream) -> None:
        pass

    def event(self, device: int) -> object:
        return object()

    def ipc_event(self, device: int) -> tuple[object, bytes]:
        raise InvalidArgumentError("host memory has no interprocess events (device buffers only)")

    def record(self, event: object, stream: HostStream) -> None:
        pass  # everything enqueued so far has already run

    def wait(self, stream: HostStream, event: object) -> None:
        pass

    def synchronize(self, event: object, deadline: float) -> None:
        pass

    def wait_ready(self, event: object, deadline: float) -> None:
        pass

    def copy_async(self, dst: Span, src: Span, stream: HostStream) -> None:
        if dst.nbytes != src.nbytes:
            raise InvalidArgumentError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        np.copyto(_view(dst), _view(src))

    def reduce_async(
        self, reduction: Reduction, out: Span, acc: Span, incoming: Span, final: bool, stream: HostStream
    ) -> None:
        target = _view(out).view(reduction.dtype)
        reduction.combine(_view(acc).view(reduction.dtype), _view(incoming).view(reduction.dtype), target)
        if final:
            reduction.finalize(target)

    def enable_peer_access(self, device: int, peer: int) -> bool:
        return True

    def close_kind(self) -> None:
        pass
