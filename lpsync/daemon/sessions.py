"""Sessions (one per attached training process) and the buffers they hold.

Ownership: the table owns every SharedSegment; a buffer belongs to exactly one
session and is unlinked when released, when its session ends (Detach, stream closed,
process killed) or when the daemon shuts down. Lock order: SessionTable._lock, then
a Job's lock (matching.py); never the reverse.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from lpsync.daemon.devices import DeviceBuffer, DeviceRegistry
from lpsync.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnimplementedError,
)
from lpsync.memory import SharedSegment
from lpsync.memory.kind import Span


@dataclass
class Buffer:
    handle: int
    segment: SharedSegment | None  # host memory; None for a device buffer
    staged: bool  # Register: the client copies its own memory in and out
    device: DeviceBuffer | None = None  # a registered device span (devices.py)

    @property
    def nbytes(self) -> int:
        return self.device.nbytes if self.device is not None else self.segment.nbytes

    def free(self, devices: DeviceRegistry | None) -> None:
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
        elif devices is not None and self.device is not None:
            devices.release(self.device)


@dataclass
class Session:
    id: str
    job: str
    rank: int
    world_size: int
    pid: int
    local_world_size: int = 0  # > 0: a multi-node job with this many ranks per node
    attached_at: float = field(default_factory=time.time)
    buffers: dict[int, Buffer] = field(default_factory=dict)
    # Typed views of the buffers by (handle, offset, dtype, count): planned once, reused.
    views: dict[tuple, np.ndarray] = field(default_factory=dict)
    nbytes: int = 0
    # Called once when the session ends (closes its Session stream's response side).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    stream_bound: bool = False
    closed: bool = False  # removed from the table; its buffers are freed
    ended: bool = False  # end_session ran (servicer.py)


class SessionTable:
    def __init__(self, max_buffer_bytes: int, max_session_bytes: int,
                 on_bytes: Callable[[int], None] | None = None,
                 devices: DeviceRegistry | None = None) -> None:
        self.max_buffer_bytes, self.max_session_bytes = max_buffer_bytes, max_session_bytes
        self.devices = devices  # None: a cpu daemon
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._handles = itertools.count(1)
        self._total = 0
        self._on_bytes = on_bytes or (lambda total: None)

    def create(self, job: str, rank: int, world_size: int, local_rank: int,
               local_world_size: int, pid: int, multinode: bool = False) -> Session:
        """``multinode``: this daemon has peers, so a job may span nodes (node-major ranks,
        LOCAL_WORLD_SIZE ranks on every node)."""
        if not job:
            raise InvalidArgumentError("attach needs a job name (LPSYNC_JOB)")
        if world_size < 1 or rank >= world_size:
            raise InvalidArgumentError(f"rank {rank} is not in a world of size {world_size}")
        spans = bool(local_world_size) and (local_world_size != world_size
                                            or local_rank != rank)
        if spans and not multinode:
            raise UnimplementedError(
                f"job {job!r} spans several nodes (world size {world_size}, local world size "
                f"{local_world_size}) but this daemon has no peers: start it with --peers, "
                "--peers-dns or --peers-slurm")
        if spans and (world_size % local_world_size or local_rank != rank % local_world_size):
            raise InvalidArgumentError(
                f"job {job!r}: rank {rank}, local rank {local_rank}, local world size "
                f"{local_world_size}, world size {world_size} is not a node-major layout "
                "(RANK = node_rank * LOCAL_WORLD_SIZE + LOCAL_RANK, the same "
                "LOCAL_WORLD_SIZE on every node)")
        session = Session(secrets.token_hex(16), job, rank, world_size, pid,
                          local_world_size=local_world_size if spans else 0)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise NotFoundError(f"no session {session_id!r}: attach first (it may have ended)")
        return session

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def remove(self, session: Session) -> list[Buffer]:
        """End the session; returns its buffers, already unlinked."""
        with self._lock:
            if session.closed:
                return []
            session.closed = True
            self._sessions.pop(session.id, None)
            buffers = list(session.buffers.values())
            session.buffers.clear()
            session.views.clear()
            self._total -= session.nbytes
            session.nbytes = 0
            total = self._total
        for buffer in buffers:
            buffer.free(self.devices)
        self._on_bytes(total)
        return buffers

    def _reserve(self, session: Session, nbytes: int) -> None:
        if nbytes < 0:
            raise InvalidArgumentError(f"buffer size must be >= 0 bytes, got {nbytes}")
        if nbytes > self.max_buffer_bytes:
            raise ResourceExhaustedError(
                f"a {nbytes}-byte buffer exceeds the daemon's limit of {self.max_buffer_bytes} "
                "bytes (--max-buffer-bytes)")
        with self._lock:
            if session.nbytes + nbytes > self.max_session_bytes:
                raise ResourceExhaustedError(
                    f"session holds {session.nbytes} bytes; {nbytes} more exceeds the limit of "
                    f"{self.max_session_bytes} (--max-session-bytes); release buffers first")
            session.nbytes += nbytes
            self._total += nbytes

    def _unreserve(self, session: Session, nbytes: int) -> None:
        with self._lock:
            session.nbytes -= nbytes
            self._total -= nbytes

    def register_device(self, session: Session, kind: str, device: int, handle: bytes,
                        offset: int, nbytes: int, allocation_bytes: int) -> Buffer:
        """A client's device span: opened (or found in the IPC cache) by the registry."""
        if self.devices is None:
            raise InvalidArgumentError(
                f"this daemon serves host memory only; start it with --devices {kind}:... to "
                "register device buffers")
        self._reserve(session, nbytes)
        try:
            device_buffer = self.devices.register(kind, device, handle, offset, nbytes,
                                                  allocation_bytes)
        except BaseException:
            self._unreserve(session, nbytes)
            raise
        buffer = Buffer(next(self._handles), None, False, device_buffer)
        with self._lock:
            closed = session.closed
            if not closed:
                session.buffers[buffer.handle] = buffer
            total = self._total
        if closed:  # ended while we opened it
            buffer.free(self.devices)
            raise NotFoundError(f"session {session.id} ended")
        self._on_bytes(total)
        return buffer

    def allocate(self, session: Session, nbytes: int, staged: bool) -> Buffer:
        self._reserve(session, nbytes)  # before the (slow) segment creation
        try:
            segment = SharedSegment.create(nbytes)
        except Exception:
            self._unreserve(session, nbytes)
            raise
        buffer = Buffer(next(self._handles), segment, staged)
        with self._lock:
            if session.closed:  # ended while we created the segment
                closed = True
            else:
                closed = False
                session.buffers[buffer.handle] = buffer
            total = self._total
        if closed:
            segment.unlink()
            raise NotFoundError(f"session {session.id} ended")
        self._on_bytes(total)
        return buffer

    def release(self, session: Session, handle: int) -> None:
        with self._lock:
            buffer = session.buffers.pop(handle, None)
            if buffer is None:
                raise NotFoundError(f"session has no buffer with handle {handle}")
            session.views = {k: v for k, v in session.views.items() if k[0] != handle}
            session.nbytes -= buffer.nbytes
            self._total -= buffer.nbytes
            total = self._total
        buffer.free(self.devices)
        self._on_bytes(total)

    def view(self, session: Session, handle: int, offset: int, dtype: np.dtype,
             count: int) -> np.ndarray | Span:
        """``count`` elements of ``dtype`` at byte ``offset`` of one of the session's buffers:
        a numpy view of host memory, a Span of device memory."""
        key = (handle, offset, dtype, count)
        cached = session.views.get(key)
        if cached is not None:
            return cached
        with self._lock:
            buffer = session.buffers.get(handle)
        if buffer is None:
            raise NotFoundError(f"session has no buffer with handle {handle}")
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > buffer.nbytes:
            raise InvalidArgumentError(
                f"{count} x {dtype} at offset {offset} does not fit buffer {handle} of "
                f"{buffer.nbytes} bytes")
        if offset % dtype.itemsize:
            raise InvalidArgumentError(f"offset {offset} is not aligned to {dtype} elements")
        if buffer.device is not None:
            d = buffer.device
            view: np.ndarray | Span = Span(d.allocation.memory, d.offset + offset, count, dtype)
        else:
            view = buffer.segment.array[offset:offset + nbytes].view(dtype)
        with self._lock:
            if handle in session.buffers:  # not released meanwhile
                if len(session.views) > 256:
                    session.views.clear()
                session.views[key] = view
        return view

    def close_all(self) -> None:
        for session in self.all():
            self.remove(session)
