"""Recognising device arrays and describing them for registration, without importing CUDA.

A device array is registered as the IPC handle of its whole allocation plus where the
array starts in it: frameworks' caching allocators hand out sub-allocations of larger
cudaMalloc segments, and cudaIpcGetMemHandle names the segment, so the base and size come
from cuMemGetAddressRange (lpsync_client._cuda, through the driver with ctypes: torch,
cupy and JAX need no common library). Recognised:
  * ``__lpsync_device__`` (lpsync_client.emulated arrays, the CI stand-in);
  * ``__cuda_array_interface__`` (cupy, torch CUDA tensors, numba, JAX GPU arrays);
  * ``__dlpack__`` with ``__dlpack_device__()`` on CUDA (kDLCUDA = 2, kDLCUDAManaged = 13).
Before a collective the array's current stream is ordered first (``sync``): an event
recorded on it is waited for, never a device-wide synchronize.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lpsync_client._convert import DTYPES
from lpsync_client.emulated import DeviceArrayInfo
from lpsync_client.errors import InvalidArgumentError

_KDL_CUDA = (2, 13)
# __cuda_array_interface__ typestr -> lpsync dtype (bfloat16 has no typestr: torch only)
_TYPESTR = {"<f2": "float16", "<f4": "float32", "<f8": "float64", "|i1": "int8",
            "<i4": "int32", "<i8": "int64", "|u1": "uint8"}


@dataclass
class DeviceOperand:
    info: DeviceArrayInfo
    sync: Callable[[], None]  # orders the array's current stream before the collective
    keep: object  # the user's array: holds the allocation alive while registered


def is_device_array(x: object) -> bool:
    if hasattr(x, "__lpsync_device__") or hasattr(x, "__cuda_array_interface__"):
        return True
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return device()[0] in _KDL_CUDA
    except Exception:
        return False


def describe(x: object) -> DeviceOperand:
    if hasattr(x, "__lpsync_device__"):
        return DeviceOperand(x.__lpsync_device__(), x.__lpsync_sync__, x)  # type: ignore[attr-defined]
    module = type(x).__module__
    if module.startswith("torch"):
        return _torch(x)
    if hasattr(x, "__cuda_array_interface__"):
        return _cai(x, _stream_sync_for(x))
    try:
        import cupy
    except ImportError:
        raise InvalidArgumentError(
            f"{type(x).__name__} lives on a CUDA device; registering it through __dlpack__ "
            "needs cupy (pip install 'lpsync-client[cuda12]')") from None
    return _cai(cupy.from_dlpack(x), _block(x), keep=x)


def _stream_sync_for(x: object) -> Callable[[], None]:
    if type(x).__module__.startswith("cupy"):
        import cupy

        def sync() -> None:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(cupy.cuda.get_current_stream())
            event.synchronize()
        return sync
    return _block(x)


def _block(x: object) -> Callable[[], None]:
    ready = getattr(x, "block_until_ready", None)  # JAX: its own stream ordering
    return (lambda: ready()) if ready is not None else (lambda: None)


def _cai(x: object, sync: Callable[[], None], keep: object = None,
         dtype: str | None = None) -> DeviceOperand:
    from lpsync_client import _cuda

    cai = x.__cuda_array_interface__  # type: ignore[attr-defined]
    name = dtype or _TYPESTR.get(cai["typestr"])
    if name is None or name not in DTYPES:
        raise InvalidArgumentError(f"device dtype {cai['typestr']} is not supported")
    strides = cai.get("strides")
    shape = tuple(cai["shape"])
    count = 1
    for n in shape:
        count *= n
    itemsize = int(cai["typestr"][2:])
    if strides is not None and count > 1:
        expected, step = [], itemsize
        for n in reversed(shape):
            expected.insert(0, step)
            step *= n
        if tuple(strides) != tuple(expected):
            raise InvalidArgumentError("the device array must be C-contiguous")
    pointer = int(cai["data"][0])
    device, base, size, handle = _cuda.allocation_of(pointer)
    return DeviceOperand(DeviceArrayInfo("cuda", device, handle, size, pointer - base,
                                         count * itemsize, count, name), sync,
                         keep if keep is not None else x)


def _torch(t: object) -> DeviceOperand:
    import torch

    if t.device.type != "cuda":  # type: ignore[attr-defined]
        raise InvalidArgumentError("only CUDA tensors are device arrays")
    if not t.is_contiguous():  # type: ignore[attr-defined]
        raise InvalidArgumentError("the tensor must be contiguous")
    device = t.device  # type: ignore[attr-defined]

    def sync() -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
    plain = t.detach()  # type: ignore[attr-defined]  # (no interface on grad-requiring tensors)
    if t.dtype == torch.bfloat16:  # type: ignore[attr-defined]
        # No typestr for bfloat16: describe the same bytes as int16.
        return _cai(plain.view(torch.int16), sync, keep=t, dtype="bfloat16")
    return _cai(plain, sync, keep=t)
