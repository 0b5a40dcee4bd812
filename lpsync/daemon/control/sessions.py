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
from typing import Any, cast

import numpy as np

from lpsync.daemon.control.limits import Limits, check_bytes, check_session_id
from lpsync.daemon.device_registry import DeviceBuffer, DeviceRegistry
from lpsync.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
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
        # A buffer has its segment or its device span (never neither).
        return self.device.nbytes if self.device is not None else cast(SharedSegment, self.segment).nbytes

    def free(self, devices: DeviceRegistry | None, wait: bool = True) -> None:
        """``wait=False``: a device mapping's close may run later, on the registry's thread."""
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
        elif devices is not None and self.device is not None:
            devices.release(self.device, wait)


@dataclass
class Session:
    id: str
    job: str
    rank: int
    world_size: int
    pid: int
    multinode: bool = False  # its job spans nodes
    attached_at: float = field(default_factory=time.time)
    buffers: dict[int, Buffer] = field(default_factory=dict)
    # Interprocess events the client's collectives wait on, opened once: (device, handle).
    events: dict[tuple[int, bytes], Any] = field(default_factory=dict)
    # Typed views of the buffers by (handle, offset, dtype, count): planned once, reused.
    views: dict[tuple, np.ndarray | Span] = field(default_factory=dict)
    # Collective requests checked before, by their fields (admission.py): a rank repeats
    # its collectives, and a repeat needs neither the checks nor the views again.
    requests: dict[tuple, Any] = field(default_factory=dict)
    nbytes: int = 0
    reserved: int = 0  # buffers held or being created (bounded by max_session_buffers)
    # Called once when the session ends (closes its Session stream's response side).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    stream_bound: bool = False
    closed: bool = False  # removed from the table; its buffers are freed
    ended: bool = False  # end_session ran (state.py)


class SessionTable:
    def __init__(
        self,
        limits: Limits,
        on_bytes: Callable[[int], None] | None = None,
        devices: DeviceRegistry | None = None,
    ) -> None:
        self.limits = limits
        self.devices = devices  # None: a cpu daemon
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._handles = itertools.count(1)
        self._total = 0
        self._on_bytes = on_bytes or (lambda total: None)

    def create(self, job: str, rank: int, world_size: int, pid: int, multinode: bool = False) -> Session:
        """``multinode``: the job spans nodes (its layout, control/layout.py). The fields
        were checked (limits.py)."""
        session = Session(secrets.token_hex(16), job, rank, world_size, pid, multinode=multinode)
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                raise ResourceExhaustedError(
                    f"the daemon holds {len(self._sessions)} sessions, its limit "
                    f"(--max-sessions {self.limits.max_sessions}); detach idle clients first"
                )
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        check_session_id(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise NotFoundError(f"no session {session_id!r}: attach first (it may have ended)")
        return session

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def remove(self, session: Session, wait: bool = False) -> list[Buffer]:
        """End the session; returns its buffers, already unlinked (device mappings closed
        when ``wait``, else handed to the device registry's thread)."""
        with self._lock:
            if session.closed:
                return []
            session.closed = True
            self._sessions.pop(session.id, None)
            buffers = list(session.buffers.values())
            session.buffers.clear()
            events = list(session.events.values())
            session.events.clear()
            session.views.clear()
            session.requests.clear()  # they hold views too: the segments could not close
            self._total -= session.nbytes
            session.nbytes = session.reserved = 0
            total = self._total
        for buffer in buffers:
            buffer.free(self.devices, wait)  # without wait: often on the event loop
        if self.devices is not None:
            for event in events:  # a stream still waiting on one gives up (kind.close_event)
                self.devices.kind.close_event(event)
            # Its done events: destroyed now, or once the collective holding one finished.
            self.devices.context.done_events.drop(session.id)
        self._on_bytes(total)
        return buffers

    def ready_event(self, session: Session, device: int, handle: bytes) -> Any:
        """The client's interprocess event ``handle``, opened on ``device`` on first use and
        kept until the session ends (CUDA: one open per handle per process)."""
        key = (device, handle)
        with self._lock:
            event = session.events.get(key)
        if event is not None:
            return event
        if self.devices is None:
            raise InvalidArgumentError("this daemon serves host memory only: no device events")
        event = self.devices.kind.open_event(handle, device)
        with self._lock:
            closed, full = session.closed, len(session.events) >= 64
            if not closed and not full:
                return session.events.setdefault(key, event)
        self.devices.kind.close_event(event)
        if closed:
            raise NotFoundError("the session ended")
        raise InvalidArgumentError("more than 64 distinct ready events in one session")

    def _reserve(self, session: Session, nbytes: int) -> None:
        """Count a new buffer against every limit before it is created (so that concurrent
        calls see it); _unreserve gives it back if creating it fails."""
        check_bytes("nbytes", nbytes, self.limits)
        limits = self.limits
        with self._lock:
            if session.nbytes + nbytes > limits.max_session_bytes:
                raise ResourceExhaustedError(
                    f"nbytes {nbytes}: the session holds {session.nbytes} bytes and the limit "
                    f"is {limits.max_session_bytes} (--max-session-bytes); release buffers "
                    "first"
                )
            if self._total + nbytes > limits.max_total_bytes:
                raise ResourceExhaustedError(
                    f"nbytes {nbytes}: the daemon's sessions hold {self._total} bytes and the "
                    f"limit is {limits.max_total_bytes} (--max-total-bytes)"
                )
            if session.reserved >= limits.max_session_buffers:
                raise ResourceExhaustedError(
                    f"the session holds {session.reserved} buffers, its limit "
                    f"(--max-session-buffers {limits.max_session_buffers}); release some first"
                )
            # Reserved before the (slow) segment creation, so concurrent calls see them.
            session.nbytes += nbytes
            session.reserved += 1
            self._total += nbytes

    def _unreserve(self, session: Session, nbytes: int) -> None:
        with self._lock:
            if not session.closed:  # remove() already gave back the whole session's
                session.nbytes -= nbytes
                session.reserved -= 1
                self._total -= nbytes

    def register_device(
        self,
        session: Session,
        kind: str,
        device: int,
        handle: bytes,
        offset: int,
        nbytes: int,
        allocation_bytes: int,
    ) -> Buffer:
        """A client's device span: opened (or found in the IPC cache) by the registry."""
        if self.devices is None:
            raise InvalidArgumentError(
                f"this daemon serves host memory only; start it with --devices {kind}:... to "
                "register device buffers"
            )
        self._reserve(session, nbytes)
        try:
            device_buffer = self.devices.register(kind, device, handle, offset, nbytes, allocation_bytes)
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
            if session.closed:  # ended while we created the segment (remove() reset it)
                closed = True
            else:
                closed = False
                session.buffers[buffer.handle] = buffer
            total = self._total
        if closed:
            segment.unlink()
            segment.close()
            raise NotFoundError(f"session {session.id} ended")
        self._on_bytes(total)
        return buffer

    def release(self, session: Session, handle: int) -> None:
        with self._lock:
            buffer = session.buffers.pop(handle, None)
            if buffer is None:
                raise NotFoundError(f"session has no buffer with handle {handle}")
            session.views = {k: v for k, v in session.views.items() if k[0] != handle}
            session.requests = {}
            session.nbytes -= buffer.nbytes
            session.reserved -= 1
            self._total -= buffer.nbytes
            total = self._total
        buffer.free(self.devices)
        self._on_bytes(total)

    def view(
        self, session: Session, handle: int, offset: int, dtype: np.dtype, count: int
    ) -> np.ndarray | Span:
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
                f"{count} x {dtype} at offset {offset} does not fit buffer {handle} of {buffer.nbytes} bytes"
            )
        if offset % dtype.itemsize:
            raise InvalidArgumentError(f"offset {offset} is not aligned to {dtype} elements")
        if buffer.device is not None:
            d = buffer.device
            view: np.ndarray | Span = Span(d.allocation.memory, d.offset + offset, count, dtype)
        else:
            assert buffer.segment is not None  # a host buffer
            view = buffer.segment.array[offset : offset + nbytes].view(dtype)
        with self._lock:
            if handle in session.buffers:  # not released meanwhile
                if len(session.views) > 256:
                    session.views.clear()
                session.views[key] = view
        return view

    def close_all(self) -> None:
        for session in self.all():
            self.remove(session)
