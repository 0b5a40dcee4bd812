"""Recognising device arrays and describing them for registration, without importing CUDA.

A device array is registered as the IPC handle of its whole allocation plus where the
array starts in it: frameworks' caching allocators hand out sub-allocations of larger
cudaMalloc segments, and cudaIpcGetMemHandle names the segment, so the base and size come
from cuMemGetAddressRange (lpsync_client._cuda, through the driver with ctypes: torch,
cupy and JAX need no common library). Recognised:
  * ``__lpsync_device__`` (lpsync_client.emulated arrays, the CI stand-in), and torch CPU
    tensors whose memory is emulated device memory (emulated.tensor: the stand-in for a
    CUDA tensor, found by address);
  * ``__cuda_array_interface__`` (cupy, torch CUDA tensors, numba, JAX GPU arrays);
  * ``__dlpack__`` with ``__dlpack_device__()`` on CUDA (kDLCUDA = 2, kDLCUDAManaged = 13).
Before a collective the array's current stream is ordered first: where the framework has
interprocess events (cupy, torch, the emulated arrays) ``ready`` records one on the
current stream and returns its IPC handle, which the request carries and the daemon's
streams wait on (cudaIpcGetEventHandle / cudaStreamWaitEvent: the client does not block);
otherwise (JAX, other __cuda_array_interface__ or __dlpack__ arrays) ``sync`` waits on the
host for the array's stream, never a device-wide synchronize. After a stream-ordered
answer (issue 47, item 1) ``done_waiter`` makes the submitter's current stream wait on
the daemon's done event (cudaIpcOpenEventHandle once per handle, cudaStreamWaitEvent per call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from lpsync_client import emulated
from lpsync_client._convert import DTYPES
from lpsync_client._ready import ReadyEvents
from lpsync_client.emulated import DeviceArrayInfo
from lpsync_client.errors import InvalidArgumentError
from lpsync_client.wire import with_device_uuid

if TYPE_CHECKING:
    import torch

_KDL_CUDA = (2, 13)
# __cuda_array_interface__ typestr -> lpsync dtype (bfloat16 has no typestr: torch only)
_TYPESTR = {
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "|i1": "int8",
    "<i4": "int32",
    "<i8": "int64",
    "|u1": "uint8",
}


class _LpsyncDeviceArray(Protocol):
    """What ``__lpsync_device__`` promises (lpsync_client.emulated.EmulatedArray);
    ``__lpsync_ready__`` is optional."""

    def __lpsync_device__(self) -> DeviceArrayInfo: ...

    def __lpsync_sync__(self) -> None: ...


@dataclass
class DeviceOperand:
    info: DeviceArrayInfo
    sync: Callable[[], None]  # orders the array's current stream before the collective (host)
    keep: object  # the user's array: holds the allocation alive while registered
    ready: Callable[[], bytes] | None = None  # records an interprocess event: its handle
    # What keeps the array's memory allocated without keeping the array (torch: its
    # storage, cupy: its Memory, emulated: its Allocation): a hold=False registration
    # holds it until released, so the caching allocator can neither reuse the block nor
    # cudaFree its segment (empty_cache, an OOM retry, free_all_blocks) while the daemon
    # maps it. None where the framework does not say (JAX, numba): the array is held.
    memory: object = None
    # Called on the submitting thread (whose current stream the ready event was recorded
    # on: cupy's and torch's current streams are per thread): the waiter that makes that
    # stream wait on the daemon's done event (its IPC handle), a stream-ordered answer's,
    # on whatever thread the answer arrives. None: the framework cannot (the daemon then
    # answers once finished).
    done_waiter: Callable[[], Callable[[bytes], None]] | None = None

    def order(self) -> bytes:
        """Order the current stream before the collective: the event handle the daemon
        waits on, or b"" after a host wait where the framework has no IPC events."""
        if self.ready is not None:
            return self.ready()
        self.sync()
        return b""


def emulated_span(x: object) -> tuple[emulated.Allocation, int] | None:
    """(allocation, offset) of a torch CPU tensor whose memory is emulated device memory;
    None for anything else (no lookup at all while the process has no emulated memory)."""
    if not emulated.in_use() or not type(x).__module__.startswith("torch"):
        return None
    t = cast("torch.Tensor", x)
    if t.device.type != "cpu" or t.is_sparse or not t.numel():
        return None
    return emulated.find(t.data_ptr(), t.numel() * t.element_size())


def is_device_array(x: object) -> bool:
    if hasattr(x, "__lpsync_device__") or hasattr(x, "__cuda_array_interface__"):
        return True
    if emulated_span(x) is not None:
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
        emulated = cast(_LpsyncDeviceArray, x)
        return DeviceOperand(
            emulated.__lpsync_device__(),
            emulated.__lpsync_sync__,
            x,
            getattr(x, "__lpsync_ready__", None),
            getattr(x, "allocation", None),
            _per_process(getattr(x, "__lpsync_wait__", None)),
        )
    module = type(x).__module__
    if module.startswith("torch"):
        found = emulated_span(x)
        return _torch(x) if found is None else _emulated_tensor(x, *found)
    if hasattr(x, "__cuda_array_interface__"):
        operand = _cai(x, _stream_sync_for(x))
        if type(x).__module__.startswith("cupy"):
            operand.ready = _cupy_ready(operand.info.device)
            operand.done_waiter = _cupy_wait(operand.info.device)
            operand.memory = _cupy_memory(x)
        return operand
    try:
        import cupy
    except ImportError:
        raise InvalidArgumentError(
            f"{type(x).__name__} lives on a CUDA device; registering it through __dlpack__ "
            "needs cupy (pip install 'lpsync-client[cuda12]')"
        ) from None
    # cupy.from_dlpack hands cupy's current stream to __dlpack__(stream=...): the producer
    # orders its pending work before that stream, so waiting for it orders the array.
    imported = cupy.from_dlpack(x)  # its Memory holds the DLPack capsule, so the producer's memory
    operand = _cai(imported, _cupy_stream_sync(), keep=x)
    operand.memory = _cupy_memory(imported)
    return operand


def _cupy_memory(x: object) -> object:
    """A cupy array's Memory (PooledMemory from the pool: its block returns to the pool
    when this is collected, not when the array is)."""
    return x.data.mem  # type: ignore[attr-defined]


def _cupy_stream_sync() -> Callable[[], None]:
    import cupy

    def sync() -> None:
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.get_current_stream())
        event.synchronize()

    return sync


def _stream_sync_for(x: object) -> Callable[[], None]:
    if type(x).__module__.startswith("cupy"):
        return _cupy_stream_sync()
    return _block(x)


# Interprocess events per (framework, device, stream), one per outstanding collective.
_events: ReadyEvents[Any] = ReadyEvents()


def _cupy_ready(device: int) -> Callable[[], bytes]:
    """Record an interprocess event on ``device``'s current cupy stream (cudaEventRecord
    on an event made with cudaEventInterprocess | cudaEventDisableTiming)."""
    import cupy

    def make() -> tuple[object, bytes]:
        event = cupy.cuda.Event(block=True, disable_timing=True, interprocess=True)
        return event, bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))

    def ready() -> bytes:
        with cupy.cuda.Device(device):  # the event is made on, and recorded on, this device
            stream = cupy.cuda.get_current_stream()
            event, handle = _events.take(("cupy", device, stream.ptr), make, lambda e: bool(e.done))
            event.record(stream)
            return handle

    return ready


def _torch_ready(device: torch.device) -> Callable[[], bytes]:
    """The same with torch's current stream and torch.cuda.Event(interprocess=True); torch
    creates the event at its first record, so the handle is taken after one."""
    import torch

    def ready() -> bytes:
        stream = torch.cuda.current_stream(device)

        def make() -> tuple[object, bytes]:
            event = torch.cuda.Event(enable_timing=False, blocking=True, interprocess=True)
            event.record(stream)
            return event, bytes(event.ipc_handle())

        key = ("torch", stream.device_index, stream.cuda_stream)
        event, handle = _events.take(key, make, lambda e: bool(e.query()))
        event.record(stream)
        return handle

    return ready


# The daemon's done events opened here, by handle (its pools are bounded, so the same
# handles come back): cudaIpcOpenEventHandle once per handle per process.
_opened: dict[tuple[str, int, bytes], Any] = {}


def _opened_event(key: tuple[str, int, bytes], open_: Callable[[], Any]) -> Any:
    event = _opened.get(key)
    if event is None:
        event = _opened[key] = open_()
    return event


def _per_process(
    wait: Callable[[bytes], None] | None,
) -> Callable[[], Callable[[bytes], None]] | None:
    """A done waiter for streams that are the process's, not a thread's (emulated)."""
    return None if wait is None else (lambda: wait)


def _cupy_wait(device: int) -> Callable[[], Callable[[bytes], None]]:
    """cudaStreamWaitEvent(the submitter's current stream, the daemon's done event, 0):
    that stream's later work waits for the collective; the host does not."""
    import cupy

    runtime = cupy.cuda.runtime

    def bind() -> Callable[[bytes], None]:
        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream()  # per thread: the submitter's

        def wait(handle: bytes) -> None:
            with cupy.cuda.Device(device):
                event = _opened_event(("cupy", device, handle), lambda: runtime.ipcOpenEventHandle(handle))
                runtime.streamWaitEvent(stream.ptr, event, 0)

        return wait

    return bind


def _torch_wait(device: torch.device) -> Callable[[], Callable[[bytes], None]]:
    """The same through torch: Event.from_ipc_handle, then the submitter's current
    stream's wait_event."""
    import torch

    def bind() -> Callable[[bytes], None]:
        stream = torch.cuda.current_stream(device)  # per thread: the submitter's

        def wait(handle: bytes) -> None:
            index = stream.device_index
            event = _opened_event(
                ("torch", index, handle), lambda: torch.cuda.Event.from_ipc_handle(index, handle)
            )
            stream.wait_event(event)

        return wait

    return bind


def _block(x: object) -> Callable[[], None]:
    ready = getattr(x, "block_until_ready", None)  # JAX: its own stream ordering
    return (lambda: ready()) if ready is not None else (lambda: None)


def _cai(x: object, sync: Callable[[], None], keep: object = None, dtype: str | None = None) -> DeviceOperand:
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
        expected: list[int] = []
        step = itemsize
        for n in reversed(shape):
            expected.insert(0, step)
            step *= n
        if tuple(strides) != tuple(expected):
            raise InvalidArgumentError("the device array must be C-contiguous")
    pointer = int(cai["data"][0])
    operand = cuda_span(pointer, count * itemsize, count, name, sync, keep if keep is not None else x)
    stream = cai.get("stream") if cai.get("version", 0) >= 3 else None
    if stream is not None and dtype is None and keep is None:
        # CAI v3: the producer's stream must be synchronized on before the data is used.
        operand.sync = functools.partial(_cuda.stream_synchronize, operand.info.device, int(stream))
    return operand


def cuda_span(
    pointer: int, nbytes: int, count: int, dtype: str, sync: Callable[[], None], keep: object
) -> DeviceOperand:
    """``count`` elements of ``dtype`` at a CUDA device pointer, described by the IPC
    handle of the allocation holding them; also for arrays whose __cuda_array_interface__
    cannot name their dtype (JAX's bfloat16)."""
    from lpsync_client import _cuda

    found = _cuda.allocation_of(pointer)
    handle = with_device_uuid(found.handle, found.uuid)  # the daemon maps it by UUID
    return DeviceOperand(
        DeviceArrayInfo(
            "cuda", found.ordinal, handle, found.size, pointer - found.base, nbytes, count, dtype
        ),
        sync,
        keep,
    )


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
        operand = _cai(plain.view(torch.int16), sync, keep=t, dtype="bfloat16")
    else:
        operand = _cai(plain, sync, keep=t)
    operand.ready = _torch_ready(device)
    operand.done_waiter = _torch_wait(device)
    # The storage, not the tensor: its block returns to the caching allocator only when
    # the last reference to the storage goes.
    operand.memory = t.untyped_storage()  # type: ignore[attr-defined]
    return operand


def _emulated_tensor(t: object, allocation: emulated.Allocation, offset: int) -> DeviceOperand:
    """A torch tensor in emulated device memory, described as the emulated array of the
    same bytes; its allocation is the memory a hold=False registration keeps."""
    import torch

    tensor = cast(torch.Tensor, t)
    if not tensor.is_contiguous():
        raise InvalidArgumentError("the tensor must be contiguous")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgumentError(f"device dtype {tensor.dtype} is not supported")
    array = allocation.array(offset, tensor.numel(), name)

    def wait_done(handle: bytes) -> None:
        # A CPU tensor's later work runs on the host, not on a stream: the host waits.
        array.__lpsync_wait__(handle)
        array.__lpsync_sync__()

    return DeviceOperand(
        array.__lpsync_device__(),
        array.__lpsync_sync__,
        t,
        array.__lpsync_ready__,
        allocation,
        _per_process(wait_done),
    )
