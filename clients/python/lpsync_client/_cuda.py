"""The CUDA driver calls the client needs, through ctypes (imported only for CUDA arrays).

  cuPointerGetAttribute(BUFFER_ID)            one call per known allocation (the cache below)
  cuPointerGetAttribute(DEVICE_ORDINAL, IS_MANAGED, IS_LEGACY_CUDA_IPC_CAPABLE)
  cuDeviceGetUuid_v2(&uuid, device)           how the daemon names the GPU (its ordinal differs
                                              under another CUDA_VISIBLE_DEVICES); _v2 tells
                                              MIG instances apart (v1 gives every instance
                                              its parent GPU's uuid); v1 only where a driver
                                              older than CUDA 11.4 lacks _v2
  cuMemGetAddressRange_v2(&base, &size, ptr)  the allocation containing ptr
  cuIpcGetMemHandle(&handle, base)            64 bytes naming the allocation
  cuStreamSynchronize(stream)                 a __cuda_array_interface__ producer's stream
The context calls run with the device's primary context pushed (cuDevicePrimaryCtxRetain,
the context the runtime API and every framework use), so they work from any thread.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lpsync_client.errors import InvalidArgumentError

_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_*: unique per allocation for the process's lifetime
_IS_MANAGED = 8
_DEVICE_ORDINAL = 9
_IPC_CAPABLE = 10  # IS_LEGACY_CUDA_IPC_CAPABLE: cudaIpcGetMemHandle works on it
_CACHE_ENTRIES = 4096

NOT_EXPORTABLE = (
    "this allocation cannot be exported through CUDA IPC (memory from cudaMallocAsync pools, "
    "expandable segments or cuMemCreate): use torch without "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cupy's default MemoryPool rather than "
    "MemoryAsyncPool, or register a host buffer (JAX's GPU memory is not exportable: "
    "lpsync_client.jax stages it through host memory)"
)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@dataclass(frozen=True)
class CudaAllocation:
    ordinal: int  # as this process numbers the GPU
    uuid: bytes  # 16 bytes, as every process names it
    base: int
    size: int
    handle: bytes  # cuIpcGetMemHandle of ``base``


@functools.cache
def _driver() -> Any:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise InvalidArgumentError(f"no CUDA driver (libcuda.so.1): {error}") from None
    _check(cuda.cuInit(0), "cuInit", cuda)  # once per process, not per collective
    return cuda


def _check(result: int, what: str, cuda: Any = None) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        (cuda or _driver()).cuGetErrorName(result, ctypes.byref(name))
        raise InvalidArgumentError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


def _attribute(pointer: int, attribute: int, value: ctypes._SimpleCData) -> int | None:
    """A pointer attribute, or None where this driver does not know it."""
    result = _driver().cuPointerGetAttribute(ctypes.byref(value), attribute, ctypes.c_uint64(pointer))
    return None if result != 0 else int(value.value)


def device_uuid(ordinal: int) -> bytes:
    cuda = _driver()
    device, uuid = ctypes.c_int(), (ctypes.c_char * 16)()
    _check(cuda.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    name = uuid_symbol(cuda)
    _check(getattr(cuda, name)(ctypes.byref(uuid), device), name)
    return bytes(uuid.raw)


def uuid_symbol(cuda: Any) -> str:
    """cuDeviceGetUuid_v2 where the driver has it (MIG instances get their own uuids)."""
    try:
        getattr(cuda, "cuDeviceGetUuid_v2")  # noqa: B009  # a ctypes lookup, may raise
        return "cuDeviceGetUuid_v2"
    except AttributeError:
        return "cuDeviceGetUuid"


def _in_context(ordinal: int, work: Callable[[], Any]) -> Any:
    cuda = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        _check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            return work()
        finally:
            popped = ctypes.c_void_p()
            cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)


_cache: dict[int, tuple[int, CudaAllocation]] = {}  # pointer -> (buffer id, its allocation)
_cache_lock = threading.Lock()


def allocation_of(pointer: int) -> CudaAllocation:
    """The allocation holding a device pointer. Cached by pointer and checked by the
    allocation's buffer id, so a known array costs one driver call, and memory freed and
    allocated again at the same address is described afresh."""
    buffer_id = _attribute(pointer, _BUFFER_ID, ctypes.c_ulonglong())
    with _cache_lock:
        known = _cache.get(pointer)
    if known is not None and buffer_id is not None and known[0] == buffer_id:
        return known[1]
    found = _describe(pointer)
    if buffer_id is not None:
        with _cache_lock:
            if len(_cache) >= _CACHE_ENTRIES:
                _cache.clear()
            _cache[pointer] = (buffer_id, found)
    return found


def _describe(pointer: int) -> CudaAllocation:
    ordinal = _attribute(pointer, _DEVICE_ORDINAL, ctypes.c_int())
    if ordinal is None:
        raise InvalidArgumentError(f"{pointer:#x} is not CUDA device memory")
    if _attribute(pointer, _IS_MANAGED, ctypes.c_int()) == 1:
        raise InvalidArgumentError(
            "managed memory (cudaMallocManaged) cannot be exported through CUDA IPC: "
            "register a cudaMalloc'd array or a host buffer"
        )
    if _attribute(pointer, _IPC_CAPABLE, ctypes.c_int()) == 0:
        raise InvalidArgumentError(NOT_EXPORTABLE)
    cuda = _driver()

    def handle_of() -> tuple[int, int, bytes]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(
            cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)),
            "cuMemGetAddressRange",
        )
        handle = _IpcHandle()
        _check(cuda.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return base.value, size.value, ctypes.string_at(ctypes.addressof(handle), 64)

    base, size, handle = _in_context(ordinal, handle_of)
    return CudaAllocation(ordinal, device_uuid(ordinal), base, size, handle)


def stream_synchronize(ordinal: int, stream: int) -> None:
    """Wait for a producer's stream (``__cuda_array_interface__`` v3's ``stream``: 1 the
    legacy default stream, 2 the per-thread default stream, else a cudaStream_t)."""
    handle = {1: 0x1, 2: 0x2}.get(stream, stream)  # CU_STREAM_LEGACY / CU_STREAM_PER_THREAD
    _in_context(
        ordinal, lambda: _check(_driver().cuStreamSynchronize(ctypes.c_void_p(handle)), "cuStreamSynchronize")
    )
