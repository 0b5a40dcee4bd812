"""The daemon's devices: the memory kind, the IPC cache of opened allocations, and the
per-device accounting that Status and the metrics show.

Ownership: a client owns its device allocations; the daemon opens each one once (keyed
by device and IPC handle), shares the mapping between every registration on it, and
closes it when the last registration on it is released or its session ends (a client
that dies is seen through its Session stream, sessions.py). Lock order: SessionTable's
lock is never held while this registry's is taken.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lpsync.engine.device_group import DeviceContext
from lpsync.engine.staging import RING_SLOTS, RingPool
from lpsync.errors import InvalidArgumentError, NotFoundError
from lpsync.memory.kind import Memory, MemoryKind
from lpsync_client.wire import split_device_uuid

log = logging.getLogger("lpsync.daemon")

MAX_HANDLE_BYTES = 1024  # CUDA IPC handles are 64 bytes, emulated ones shorter


@dataclass(eq=False)
class OpenAllocation:
    device: int
    handle: bytes
    memory: Memory
    nbytes: int
    refs: int = 0  # registrations on it
    active: int = 0  # collectives whose streams may still touch it
    settled: bool = True  # no close deferred to ``done`` is pending
    streamed: int = 0  # of ``active``: collectives answered before they finished (issue 47)


@dataclass(eq=False)
class DeviceBuffer:
    """One registration: ``nbytes`` at ``offset`` of an opened allocation."""

    allocation: OpenAllocation
    offset: int
    nbytes: int

    @property
    def device(self) -> int:
        return self.allocation.device


RELEASE_PATIENCE = 20.0  # s a Release waits for collectives still running on its allocation


class DeviceRegistry:
    def __init__(self, kind: MemoryKind, staging_bytes: int = 32 << 20, ring_bytes: int = 0) -> None:
        self.kind = kind
        # A multi-node collective's segments cross through a ring of RING_SLOTS pinned
        # slots of staging_bytes / RING_SLOTS (hierarchy.py, packed.py), leased from one
        # pool for the whole daemon: ``ring_bytes`` of them at most (default: 4 rings).
        self.staging_bytes = staging_bytes
        self.rings = RingPool(kind, ring_bytes or 4 * staging_bytes, RING_SLOTS)
        # The direct path's rings: the daemon's own device memory, all UCX is handed.
        self.device_rings = RingPool(kind, ring_bytes or 4 * staging_bytes, RING_SLOTS, on_device=True)
        # The peer plane takes this kind's device memory as it is (the device path is
        # "device": lpsync.transport.ucx.device_support), so the boundary needs no ring.
        self.peer_direct = False
        self.context = DeviceContext(kind)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # an allocation's collectives finished
        self._open: dict[tuple[int, bytes], OpenAllocation] = {}
        self._by_memory: dict[int, OpenAllocation] = {}  # id(memory) -> its entry
        self.registered = [0] * kind.devices
        self._uuids: dict[bytes, int] | None = None  # device UUID -> this daemon's ordinal
        # Kinds that can tell a mapping whose exporter freed it (emulated; CUDA cannot).
        self._check_mapped = getattr(kind, "check_mapped", None)
        # Closes that must not run where they were asked for (the event loop): one thread.
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpsync-unmap")
        self._closed = False

    def register(
        self, kind: str, device: int, handle: bytes, offset: int, nbytes: int, allocation_bytes: int
    ) -> DeviceBuffer:
        if kind != self.kind.name:
            raise InvalidArgumentError(
                f"a {kind} buffer cannot be registered with a daemon serving {self.kind.name} "
                f"devices (--devices)"
            )
        handle, uuid = split_device_uuid(bytes(handle))
        if uuid is not None:  # the client's ordinal is its own numbering: the UUID decides
            device = self._device_of(uuid, device)
        if not 0 <= device < self.kind.devices:
            raise InvalidArgumentError(
                f"device {device} does not exist: this daemon has "
                f"{self.kind.name} devices 0..{self.kind.devices - 1}"
            )
        if not handle or len(handle) > MAX_HANDLE_BYTES:
            raise InvalidArgumentError(
                f"ipc_handle of {len(handle)} bytes: a device buffer needs the IPC handle of its "
                f"allocation (1..{MAX_HANDLE_BYTES} bytes; CUDA's is 64)"
            )
        if offset < 0 or nbytes < 0 or allocation_bytes < 0 or offset + nbytes > allocation_bytes:
            raise InvalidArgumentError(
                f"span {offset}+{nbytes} does not fit an allocation of {allocation_bytes} bytes"
            )
        key = (device, bytes(handle))
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                entry.refs += 1
        if entry is None:
            memory: Memory | None  # None once the entry holds it
            memory = self.kind.open(bytes(handle), device)  # slow on CUDA: outside the lock
            size = min(allocation_bytes, getattr(memory, "nbytes", allocation_bytes))
            with self._lock:
                entry = self._open.get(key)
                if entry is None:
                    entry = self._open[key] = OpenAllocation(device, key[1], memory, size)
                    self._by_memory[id(memory)] = entry
                    memory = None
                entry.refs += 1
            if memory is not None:  # another registration opened it meanwhile
                self.kind.close(memory)
        if offset + nbytes > entry.nbytes:
            self._drop(entry)
            raise InvalidArgumentError(
                f"span {offset}+{nbytes} does not fit the allocation ({entry.nbytes} bytes)"
            )
        with self._lock:
            self.registered[device] += nbytes
        return DeviceBuffer(entry, offset, nbytes)

    def _device_of(self, uuid: bytes, client_ordinal: int) -> int:
        with self._lock:
            if self._uuids is None:
                self._uuids = {self.kind.uuid(d): d for d in range(self.kind.devices)}
            device = self._uuids.get(uuid)
        if device is None:
            raise InvalidArgumentError(
                f"the buffer is on the client's device {client_ordinal} (UUID {uuid.hex()}), which "
                "this daemon does not serve (--devices): a GPU of another node or hidden from the daemon"
            )
        return device

    def release(self, buffer: DeviceBuffer, wait: bool = True) -> None:
        """Drop one registration; its mapping closes with the last one, once idle.
        ``wait=False`` (a session ending, on the event loop): the close runs on the
        registry's closer thread, since closing a mapping can synchronize the device."""
        with self._lock:
            self.registered[buffer.device] -= buffer.nbytes
        with self._lock:
            streamed = buffer.allocation.streamed > 0
        self._drop(buffer.allocation, wait)
        if wait and streamed:  # answered at enqueue, it may still run on the allocation:
            # the client frees the memory once this is answered, so answer after the close
            with self._idle:
                self._idle.wait_for(lambda: buffer.allocation.settled, RELEASE_PATIENCE)

    def _drop(self, entry: OpenAllocation, wait: bool = True) -> None:
        with self._lock:
            entry.refs -= 1
            last = entry.refs == 0 and entry.active == 0
            if entry.refs == 0:  # no new registration finds it; closed once idle
                self._open.pop((entry.device, entry.handle), None)
                entry.settled = last  # else ``done`` closes it
            if last:
                self._by_memory.pop(id(entry.memory), None)
        if last:
            self._close(entry.memory, wait)

    def _close(self, memory: Memory, wait: bool) -> None:
        with self._lock:
            later = not wait and not self._closed
            if later:
                self._closer.submit(self._close_logged, memory)
        if not later:
            self.kind.close(memory)

    def _close_logged(self, memory: Memory) -> None:
        try:
            self.kind.close(memory)
        except Exception:  # a failed unmap must not end the closer thread
            log.exception("closing a device mapping failed")

    def use(self, memories: list) -> list[OpenAllocation]:
        """Mark the allocations of ``memories`` busy: a release (or a client's death) while a
        collective's streams still touch them defers their close to ``done`` — closing an
        IPC mapping under a running kernel faults the daemon's whole CUDA context. An
        opened allocation already closed (released between arrival and run) refuses the
        run: on CUDA it would read and write through an unmapped address. So is one whose
        client freed the memory while registered, where the kind can tell (emulated)."""
        with self._lock:
            entries = {}
            for memory in memories:
                entry = self._by_memory.get(id(memory))
                if entry is None:
                    if getattr(memory, "closed", False):
                        raise NotFoundError(
                            "a device buffer of this collective was released (or its session "
                            "ended) before it ran"
                        )
                    continue  # the daemon's own memory (staging): not the registry's
                entries[id(entry)] = entry
            if self._check_mapped is not None:  # the emulated device: freed under us?
                for entry in entries.values():
                    self._check_mapped(entry.memory)
            for entry in entries.values():
                entry.active += 1
        return list(entries.values())

    def stream_ordered(self, entries: list[OpenAllocation]) -> bool:
        """Whether the collective holding ``entries`` (``use``) may be answered before it
        finished: not where a buffer was released while it waited (its mapping closes
        once the collective is done, and its client was promised that close before the
        answer). Where it may, a Release meanwhile waits for the close (``release``);
        ``done(entries, streamed=True)`` ends it."""
        with self._lock:
            if any(entry.refs == 0 for entry in entries):
                return False
            for entry in entries:
                entry.streamed += 1
            return True

    def done(self, entries: list[OpenAllocation], streamed: bool = False) -> None:
        closing = []
        with self._lock:
            for entry in entries:
                entry.streamed -= streamed
                entry.active -= 1
                if entry.active == 0 and entry.refs == 0:
                    self._by_memory.pop(id(entry.memory), None)
                    closing.append(entry)
        for entry in closing:
            self.kind.close(entry.memory)
        if closing:
            with self._idle:
                for entry in closing:
                    entry.settled = True
                self._idle.notify_all()

    def open_allocations(self) -> list[int]:
        counts = [0] * self.kind.devices
        with self._lock:
            for device, _ in self._open:
                counts[device] += 1
        return counts

    def counters(self) -> tuple[list[int], list[int]]:
        """Lifetime IPC opens and closes per device (kinds that count them)."""
        n = self.kind.devices
        return (list(getattr(self.kind, "opens", [0] * n)), list(getattr(self.kind, "closes", [0] * n)))

    def close(self) -> None:
        """Daemon shutdown: the streams drain first (destroying one waits for its work),
        then the idle mappings close; unmapping under queued work faults on CUDA. A
        mapping a collective still holds (one that outlived ``drain_seconds``: its peers
        may still write into it through the peer plane, which stops after this) is left
        mapped: it closes when that collective is ``done``, or the driver unmaps it when
        the process exits."""
        self.context.close()
        with self._lock:
            self._closed = True  # later closes run where they are asked for
        self._closer.shutdown(wait=True)
        with self._lock:
            entries = [e for e in self._by_memory.values() if e.active == 0]
            held = [e for e in self._by_memory.values() if e.active > 0]
            self._open.clear()
            self._by_memory = {id(e.memory): e for e in held}
            for entry in held:
                entry.refs = 0  # closed by ``done``, not by a release
        for entry in entries:
            self.kind.close(entry.memory)
        self.rings.close()
        self.device_rings.close()
        if held:
            log.warning(
                "%d device mapping(s) still held by a running collective at shutdown: left mapped "
                "until it ends (the peer plane may still write into them)",
                len(held),
            )
        self.kind.close_kind()
