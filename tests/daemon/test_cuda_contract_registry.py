"""The daemon's device registry against CUDA's rules (issue 25, points 5 and 12), on the
emulated device: an IPC mapping is never used after it closed, nor closed under queued
work."""

from __future__ import annotations

import numpy as np
import pytest

from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.errors import NotFoundError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync_client import emulated as client_emulated


def _registered(registry: DeviceRegistry, allocation: client_emulated.Allocation):
    return registry.register(
        "emulated", allocation.device, allocation.ipc_handle(), 0, allocation.nbytes, allocation.nbytes
    )


def test_cuda_contract_shutdown_drains_the_streams_before_closing_mappings():
    """Queued work that writes into a client's memory lands before its mapping closes
    (point 12): unmapping first would fault on CUDA (here: the write is lost)."""
    kind = EmulatedKind(1, copy_bandwidth=2e6)  # 200 kB: ~0.1 s of copy
    registry = DeviceRegistry(kind)
    allocation = client_emulated.Allocation(200_000, 0)
    buffer = _registered(registry, allocation)
    source = kind.allocate(0, 200_000)
    source.array[:] = 7
    target = Span(buffer.allocation.memory, 0, 200_000, np.dtype(np.uint8))
    kind.copy_async(target, Span(source, 0, 200_000, np.dtype(np.uint8)), registry.context.stream(0, 0))
    registry.close()
    assert (allocation.bytes == 7).all(), "the mapping closed before the stream drained"
    kind.free(source)
    allocation.free()


def test_cuda_contract_a_buffer_released_before_its_run_refuses_it():
    """A Release (or the session's end) between a collective's arrival and its run closes
    the mapping; the run is then refused instead of touching an unmapped address (point 5)."""
    kind = EmulatedKind(1)
    registry = DeviceRegistry(kind)
    allocation = client_emulated.Allocation(4096, 0)
    try:
        buffer = _registered(registry, allocation)
        memory = buffer.allocation.memory
        busy = registry.use([memory])  # while registered: marked busy, and released by done
        registry.done(busy)
        registry.release(buffer)
        assert kind.closes[0] == 1
        with pytest.raises(NotFoundError, match="released"):
            registry.use([memory])
        staging = kind.allocate(0, 64)  # the daemon's own memory is not the registry's
        assert registry.use([staging]) == []
        kind.free(staging)
    finally:
        registry.close()
        allocation.free()


def test_cuda_contract_a_session_end_closes_mappings_off_the_calling_thread():
    """A session's end frees its device buffers on the event loop (end_session); their
    mappings close on the registry's own thread (closing one can synchronize the device,
    point 5). A Release waits for its close (it runs off the loop already)."""
    import threading

    kind = EmulatedKind(1)
    registry = DeviceRegistry(kind)
    closed_on: list[str] = []
    close = kind.close

    def recording_close(memory) -> None:
        closed_on.append(threading.current_thread().name)
        close(memory)

    kind.close = recording_close  # type: ignore[method-assign]
    allocations = [client_emulated.Allocation(4096, 0) for _ in range(2)]
    try:
        ended, released = (_registered(registry, a) for a in allocations)
        registry.release(released)  # wait=True: closed here, before it returns
        assert closed_on == [threading.current_thread().name]
        registry.release(ended, wait=False)
        registry.close()  # waits for the closer thread
        assert len(closed_on) == 2 and closed_on[1].startswith("lpsync-unmap"), closed_on
        assert kind.closes[0] == 2
    finally:
        for a in allocations:
            a.free()


def test_cuda_contract_a_mapping_released_under_a_collective_closes_before_its_reply():
    """A Release while the collective waits defers the close; the reply then comes only
    after the close (admission's ``holding_devices``): a client frees its memory once
    answered, and a cudaFree before the importer's cudaIpcCloseMemHandle is undefined."""
    from lpsync.daemon.control.admission import holding_devices

    kind = EmulatedKind(1)
    registry = DeviceRegistry(kind)
    allocation = client_emulated.Allocation(4096, 0)
    try:
        buffer = _registered(registry, allocation)
        span = Span(buffer.allocation.memory, 0, 1024, np.dtype(np.float32))
        closed_at_reply: list[int] = []
        reply = holding_devices(
            registry,
            span,
            None,
            lambda outcome: closed_at_reply.append(kind.closes[0]),
        )
        registry.release(buffer)  # while the collective waits: deferred
        assert kind.closes[0] == 0
        reply(None)  # type: ignore[arg-type]
        assert closed_at_reply == [1], "replied before the mapping closed"
        assert not allocation.mapped_elsewhere()
    finally:
        registry.close()
        allocation.free()


def test_cuda_contract_shutdown_leaves_a_mapping_a_running_collective_holds():
    """A collective that outlived drain_seconds still holds its mapping at shutdown: its
    peers may still write into it through the peer plane, stopped after the registry
    (second reading, point 12). The mapping stays until that collective is done."""
    kind = EmulatedKind(1)
    registry = DeviceRegistry(kind)
    busy_allocation, idle_allocation = (
        client_emulated.Allocation(4096, 0),
        client_emulated.Allocation(4096, 0),
    )
    try:
        busy = _registered(registry, busy_allocation)
        _registered(registry, idle_allocation)
        running = registry.use([busy.allocation.memory])
        registry.close()
        assert kind.closes[0] == 1  # the idle one
        assert not busy.allocation.memory.closed
        busy.allocation.memory.array[:] = 5  # a late write from the peer plane lands in mapped memory
        assert (busy_allocation.bytes == 5).all()
        registry.done(running)  # the collective ends: now it closes
        assert kind.closes[0] == 2 and busy.allocation.memory.closed
    finally:
        busy_allocation.free()
        idle_allocation.free()
