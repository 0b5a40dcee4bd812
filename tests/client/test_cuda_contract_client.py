"""The client's device path against CUDA's rules (issue 25, points 2, 3, 9, 10, 14): on the
emulated device (other ordinals than the daemon's, non-exportable memory, ready events),
and the CUDA driver calls against a recording stand-in for libcuda (no GPU needed)."""

from __future__ import annotations

import ctypes
import threading
from collections import Counter

import numpy as np
import pytest

from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.errors import InvalidArgumentError as DaemonInvalidArgument
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync_client import _cuda, _device, emulated
from lpsync_client.errors import InvalidArgumentError


def _register(registry: DeviceRegistry, x: emulated.EmulatedArray):
    info = _device.describe(x).info
    return registry.register(
        info.kind, info.device, info.handle, info.offset, info.nbytes, info.allocation_bytes
    )


def test_cuda_contract_a_client_sees_its_gpu_under_another_ordinal(monkeypatch):
    """The client's device 0 is the daemon's device 1 (another CUDA_VISIBLE_DEVICES): the
    allocation is mapped on device 1, named by its UUID, not by the client's ordinal (point 2)."""
    monkeypatch.setenv("LPSYNC_EMULATED_VISIBLE_DEVICES", "1")
    kind = EmulatedKind(2)
    registry = DeviceRegistry(kind)
    x = emulated.asarray(np.arange(8, dtype=np.float32), device=0)
    try:
        buffer = _register(registry, x)
        assert buffer.device == 1 and kind.opens == [0, 1]
        mapped = kind.read(Span(buffer.allocation.memory, 0, 8, np.dtype(np.float32)))
        np.testing.assert_array_equal(mapped, np.arange(8, dtype=np.float32))
        registry.release(buffer)
    finally:
        registry.close()
        x.allocation.free()


def test_cuda_contract_a_gpu_the_daemon_does_not_serve_is_refused(monkeypatch):
    """A UUID the daemon does not know is refused, never mapped on some ordinal (point 2)."""
    monkeypatch.setenv("LPSYNC_EMULATED_VISIBLE_DEVICES", "3")
    registry = DeviceRegistry(EmulatedKind(2))
    x = emulated.zeros(8, device=0)
    try:
        with pytest.raises(DaemonInvalidArgument, match="does not serve"):
            _register(registry, x)
    finally:
        registry.close()
        x.allocation.free()


def test_cuda_contract_one_ready_event_per_outstanding_collective():
    """A ready event is recorded again only once its previous record completed: a second
    collective sent while the first one's record is pending gets another event, so the
    daemon never waits on a later record than its request's (point 3)."""
    x = emulated.zeros(16, device=0)
    stream = emulated.current_stream(0)
    blocker = threading.Event()
    stream.enqueue(lambda: blocker.wait(30))
    first = x.__lpsync_ready__()
    second = x.__lpsync_ready__()
    assert first != second
    blocker.set()
    stream.synchronize(30)
    assert x.__lpsync_ready__() in (first, second)  # idle again: reused, not one more
    x.allocation.free()


def test_cuda_contract_memory_that_cannot_be_exported_is_named():
    """Memory CUDA IPC cannot export (cudaMallocAsync pools, expandable segments) fails
    at registration with the allocator setting to change (point 9)."""
    x = emulated.Allocation(64, 0, exportable=False).array(0, 16, "float32")
    with pytest.raises(InvalidArgumentError, match="expandable_segments"):
        _device.describe(x)


class _Driver:
    """libcuda as _cuda calls it: pointer attributes, one device, recorded calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.attributes = {7: 41, 8: 0, 9: 0, 10: 1}  # buffer id, managed, ordinal, IPC-capable
        self.synchronized: list[int] = []

    def cuPointerGetAttribute(self, ref, attribute, pointer) -> int:
        self.calls["attribute"] += 1
        ref._obj.value = self.attributes[attribute]
        return 0

    def cuDeviceGet(self, ref, ordinal) -> int:
        ref._obj.value = ordinal
        return 0

    def cuDeviceGetUuid(self, ref, device) -> int:
        ref._obj.raw = b"GPU-UUID-0123456"
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, device) -> int:
        return 0

    def cuCtxPushCurrent_v2(self, context) -> int:
        return 0

    def cuCtxPopCurrent_v2(self, ref) -> int:
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device) -> int:
        return 0

    def cuMemGetAddressRange_v2(self, base, size, pointer) -> int:
        base._obj.value, size._obj.value = 0x10000, 1 << 20
        return 0

    def cuIpcGetMemHandle(self, ref, base) -> int:
        self.calls["ipc"] += 1
        ctypes.memmove(ctypes.addressof(ref._obj), b"H" * 64, 64)
        return 0

    def cuStreamSynchronize(self, stream) -> int:
        self.synchronized.append(stream.value)
        return 0

    def cuGetErrorName(self, result, ref) -> int:
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = _Driver()
    monkeypatch.setattr(_cuda, "_driver", lambda: fake)
    monkeypatch.setattr(_cuda, "_cache", {})
    return fake


def test_cuda_contract_an_allocation_is_described_once(driver):
    """A known allocation costs one driver call per collective, not cuInit + a context
    push + an IPC handle (point 14); memory freed and allocated again is described afresh."""
    first = _cuda.allocation_of(0x10040)
    calls = driver.calls["attribute"]
    assert _cuda.allocation_of(0x10040) == first
    assert driver.calls["ipc"] == 1 and driver.calls["attribute"] == calls + 1
    assert first.uuid == b"GPU-UUID-0123456" and (first.base, first.size) == (0x10000, 1 << 20)
    driver.attributes[7] = 42  # another allocation at the same address
    _cuda.allocation_of(0x10040)
    assert driver.calls["ipc"] == 2


def test_cuda_contract_non_ipc_memory_is_refused_by_name(driver):
    """IS_LEGACY_CUDA_IPC_CAPABLE == 0 (a cudaMallocAsync pool, VMM) and managed memory are
    refused before cuIpcGetMemHandle, naming what to change (point 9)."""
    driver.attributes[10] = 0
    with pytest.raises(InvalidArgumentError, match="expandable_segments"):
        _cuda.allocation_of(0x10040)
    driver.attributes[10], driver.attributes[8] = 1, 1
    with pytest.raises(InvalidArgumentError, match="managed"):
        _cuda.allocation_of(0x10040)
    assert driver.calls["ipc"] == 0


class _NumbaLike:
    """A __cuda_array_interface__ v3 producer with work pending on its own stream."""

    def __init__(self, stream: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x10040, False),
            "version": 3,
            "stream": stream,
        }


def test_cuda_contract_the_cuda_array_interface_stream_is_honoured(driver):
    """CAI v3's ``stream``: the collective is ordered after the producer's stream (point 10),
    and the handle carries the GPU's UUID (point 2)."""
    operand = _device.describe(_NumbaLike(0xABC))
    assert operand.order() == b""  # no IPC event for this producer: the host waits
    assert driver.synchronized == [0xABC]
    assert operand.info.handle.endswith(b"GPU-UUID-0123456")
