"""lpsync_client.jax (JAX on CPU, for real) and lpsync_client.cupy (GPU only) against
numpy, through a real daemon and rank processes; and the missing-framework messages."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import lpsync_client
from tests.daemon.harness import DaemonProcess, run_ranks
from tests.training.adapter_workers import cupy_ranks, inputs, jax_ranks

WORLD = 3


def test_jax_allreduce_matches_numpy(daemon: DaemonProcess) -> None:
    pytest.importorskip("jax")
    results = run_ranks(WORLD, jax_ranks, WORLD, daemon.socket, "jax", timeout=120)
    for step, (op, grow) in enumerate((("sum", False), ("avg", True), ("max", False))):
        every = [inputs(r, grow) for r in range(WORLD)]
        for rank in range(WORLD):
            got = results[rank][step]
            assert got["op"] == op
            for key in got:
                if key == "op":
                    continue
                source = "d" if key == "d2" else key
                stack = np.stack([x[source] * (2 if key == "d2" else 1) for x in every])
                want = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0)}[op]
                assert got[key].dtype == every[0][source].dtype, (op, key)
                np.testing.assert_allclose(
                    got[key], want, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {op} {key}"
                )
    for rank in range(WORLD):
        np.testing.assert_allclose(results[rank][-1]["x"], np.full(3, 1.0))  # mean of 0, 1, 2


@pytest.mark.gpu
def test_cupy_allreduce_matches_numpy(daemon: DaemonProcess) -> None:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (GPU machines only)")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    results = run_ranks(WORLD, cupy_ranks, WORLD, daemon.socket, "cupy", timeout=120)
    every = [inputs(r) for r in range(WORLD)]
    keys = sorted(k for k in every[0] if k != "c")
    for rank in range(WORLD):
        for key, got in zip(keys, results[rank], strict=True):
            np.testing.assert_allclose(got, sum(x[key] for x in every), rtol=1e-6)


@pytest.mark.parametrize(
    "module,framework,extra",
    [
        ("lpsync_client.jax", "jax", "lpsync-client[jax]"),
        ("lpsync_client.cupy", "cupy", "lpsync-client[cupy]"),
        ("lpsync_client.torch", "torch", "lpsync-client[torch]"),
    ],
)
def test_missing_framework_says_what_to_install(module: str, framework: str, extra: str) -> None:
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"
        f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n"
        f"else:\n    print('imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert extra in out and "not installed" in out, out


def test_jax_gpu_memory_that_cannot_be_exported_takes_the_host_path(monkeypatch) -> None:
    """JAX 0.11's GPU allocators give memory CUDA IPC cannot export (seen on an H200): the
    adapter asks once, warns once, and sends GPU leaves through host memory."""
    pytest.importorskip("jax")
    import lpsync_client.jax as lpj
    from lpsync_client._cuda import NOT_EXPORTABLE

    asked: list[object] = []

    class Leaf:  # what _exportable reads of a GPU leaf
        nbytes, size, dtype = 4, 1, np.dtype(np.float32)

        def __init__(self, name: str) -> None:
            self.name = name

        def unsafe_buffer_pointer(self) -> int:
            return 1 << 20

    def refuse(pointer: int, nbytes: int, size: int, dtype: str, release: object, owner: Leaf) -> None:
        asked.append(owner.name)  # the CUDA driver's answer for JAX's memory
        raise lpsync_client.InvalidArgumentError(NOT_EXPORTABLE)

    monkeypatch.setattr(lpj, "cuda_span", refuse)
    monkeypatch.setattr(lpj, "_EXPORTABLE", [])
    with pytest.warns(RuntimeWarning, match="through host memory"):
        assert lpj._exportable(Leaf("leaf 1")) is False
    assert lpj._exportable(Leaf("leaf 2")) is False
    assert asked == ["leaf 1"]
