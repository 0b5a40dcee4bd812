"""The client's recognition of device arrays, without a GPU: what is one, what is not,
and the errors when CUDA is missing. (The CUDA calls themselves: test_daemon_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import lpsync_client
from lpsync_client import emulated
from lpsync_client._device import describe, is_device_array


class _Dlpack:
    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("not called")

    def __dlpack_device__(self):
        return (self.device_type, 0)


class _FakeCuda:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}


def test_what_is_a_device_array():
    torch = pytest.importorskip("torch")
    assert not is_device_array(np.zeros(3))
    assert not is_device_array(torch.zeros(3))  # CPU tensors are host memory (staged)
    assert not is_device_array(_Dlpack(1))  # kDLCPU
    assert is_device_array(_Dlpack(2))  # kDLCUDA
    assert is_device_array(_Dlpack(13))  # kDLCUDAManaged
    assert is_device_array(_FakeCuda())
    assert is_device_array(emulated.zeros(3))


def test_emulated_arrays_describe_their_allocation():
    alloc = emulated.Allocation(4096, device=3)
    info = describe(alloc.array(1024, 10, "int32")).info
    assert (
        info.kind,
        info.device,
        info.allocation_bytes,
        info.offset,
        info.nbytes,
        info.count,
        info.dtype,
    ) == ("emulated", 3, 4096, 1024, 40, 10, "int32")
    assert info.handle == alloc.ipc_handle()
    with pytest.raises(lpsync_client.InvalidArgumentError, match="does not fit"):
        alloc.array(4090, 10, "int32")


def test_cuda_arrays_without_a_driver_fail_cleanly():
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    with pytest.raises(lpsync_client.InvalidArgumentError, match="CUDA driver"):
        describe(_FakeCuda())


def test_emulated_stream_orders_writes():
    x = emulated.zeros(4, "float32", device=0)
    x.set_async([1, 2, 3, 4], delay=0.2)
    assert x.host.tolist() == [0, 0, 0, 0]  # still queued
    assert x.get().tolist() == [1, 2, 3, 4]  # get() waits for the stream
