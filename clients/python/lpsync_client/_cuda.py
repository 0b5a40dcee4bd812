"""The CUDA driver calls the client needs, through ctypes (imported only for CUDA arrays).

  cuMemGetAddressRange_v2(&base, &size, ptr)  the allocation containing ptr
  cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
  cuIpcGetMemHandle(&handle, base)            64 bytes naming the allocation
Each runs with the device's primary context pushed (cuDevicePrimaryCtxRetain, the
context the runtime API and every framework use), so it works from any thread.
"""

from __future__ import annotations

import ctypes
import functools

from lpsync_client.errors import InvalidArgumentError

_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise InvalidArgumentError(f"no CUDA driver (libcuda.so.1): {error}") from None


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise InvalidArgumentError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


def allocation_of(pointer: int) -> tuple[int, int, int, bytes]:
    """(device ordinal, allocation base, allocation size, IPC handle) of a device pointer."""
    cuda = _driver()
    _check(cuda.cuInit(0), "cuInit")
    ordinal = ctypes.c_int()
    _check(
        cuda.cuPointerGetAttribute(ctypes.byref(ordinal), _DEVICE_ORDINAL, ctypes.c_uint64(pointer)),
        "cuPointerGetAttribute",
    )
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(device), ordinal.value), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        _check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _check(
                cuda.cuMemGetAddressRange_v2(
                    ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)
                ),
                "cuMemGetAddressRange",
            )
            handle = _IpcHandle()
            _check(cuda.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        finally:
            popped = ctypes.c_void_p()
            cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return ordinal.value, base.value, size.value, ctypes.string_at(ctypes.addressof(handle), 64)
