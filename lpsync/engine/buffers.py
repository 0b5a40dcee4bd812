"""What the executor's Plan does to its buffers, for host arrays and for device spans.

A Plan slices, sends, receives, copies and reduces; where its buffers live decides how:
  * HostBuffers (the default): numpy arrays, reduced by numpy on the calling thread;
  * DeviceBuffers: Spans of one device (lpsync.memory.kind), handed to the transport as
    the kind's wire view (a cupy array: UCX moves device memory itself) and copied and
    reduced on the device's stream. Used by the peer plane's direct device path
    (lpsync/daemon/collectives/hierarchy.py), where UCX is CUDA-aware.

The transport reads and writes device memory outside the kind's streams, so a device
copy or reduction is complete (its event synchronized) before the Plan goes on: a send
never reads a chunk a kernel still writes, a receive never lands under a kernel still
reading its slot.
"""

from __future__ import annotations

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
