"""Shared by the ``test_cuda_contract_*`` tests: the memory kinds they run on.

Each runs on the emulated device (strict as CUDA: docs/gpu.md) and, where the test needs
nothing CUDA cannot do in one process, again on a real GPU (marker ``gpu``; skipped with
the reason where cupy or enough GPUs are missing).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span


@functools.cache
def gpus() -> tuple[int, str]:
    """(visible GPUs, why none can be used)."""
    try:
        import cupy
    except ImportError:
        return 0, "cupy is not installed (pip install 'lpsync[cuda13]')"
    try:
        return cupy.cuda.runtime.getDeviceCount(), ""
    except Exception as error:  # no driver, no device
        return 0, f"no usable CUDA device: {error}"


def kinds(need: int = 1) -> list:
    """``emulated`` and, marked ``gpu``, ``cuda`` (skipped below ``need`` GPUs)."""
    count, why = gpus()
    reason = why or f"needs {need} GPUs, {count} visible"
    return [
        "emulated",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(count < need, reason=reason)]),
    ]


def make_kind(name: str, devices: int):
    if name == "emulated":
        return EmulatedKind(devices)
    from lpsync.memory.cuda import CudaKind

    return CudaKind(tuple(range(devices)))


def write_landed(kind, span: Span, values: np.ndarray) -> None:
    """span = values, landed on return: ``kind.write`` is a pageable cudaMemcpy that may
    return before its bytes landed, and the kind's streams are not ordered after it; a
    device-to-host copy is (same legacy stream, complete on return)."""
    kind.write(span, values)
    if span.count:
        kind.read(span[:1])


def span_of(kind, device: int, values: np.ndarray, keep: list) -> Span:
    memory = kind.allocate(device, max(values.nbytes, 1))
    keep.append(memory)
    span = Span(memory, 0, values.size, values.dtype)
    write_landed(kind, span, values)
    return span
