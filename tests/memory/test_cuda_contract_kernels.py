"""The CUDA kind's reduction kernels (lpsync/memory/cuda_kernels.py: raw pointers, every
dtype and op in one source) checked bitwise against numpy and ml_dtypes without a GPU:
the same source, compiled for the host with its host prelude (the kernels are plain C
around a grid-stride loop), run through ctypes on arrays that include NaN, infinities,
signed zeros, subnormals, overflow and rounding ties (float16 and bfloat16 exhaustively
for the conversions and the division)."""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lpsync.memory import cuda_kernels
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, ReduceOp

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to build the kernels for the host")


# The conversions on their own, for the test only.
_CONVERT = r"""
void to_f16(const float* in, unsigned short* out, long long n) { LOOP(i, n) out[i] = f2h(in[i]); }
void to_bf16(const float* in, unsigned short* out, long long n) { LOOP(i, n) out[i] = f2bf(in[i]); }
void from_f16(const unsigned short* in, float* out, long long n) { LOOP(i, n) out[i] = h2f(in[i]); }
"""


@functools.cache
def _library(folder: str) -> ctypes.CDLL:
    source = Path(folder) / "kernels.c"
    source.write_text(cuda_kernels.source(cuda_kernels.HOST_PRELUDE) + _CONVERT)
    built = Path(folder) / "kernels.so"
    assert CC is not None
    subprocess.run(
        [CC, "-O2", "-shared", "-fPIC", "-fno-fast-math", "-o", str(built), str(source)], check=True
    )
    return ctypes.CDLL(str(built))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> ctypes.CDLL:
    return _library(str(tmp_path_factory.mktemp("kernels")))


def _pointer(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def _inputs(dtype: np.dtype, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays of ``n`` elements: random bit patterns plus the values that break
    conversions (every float16/bfloat16 pattern appears when n allows)."""
    if dtype.itemsize == 2 and dtype.kind in "fV":  # float16, bfloat16 (ml_dtypes: kind V)
        words = rng.integers(0, 1 << 16, size=(2, n), dtype=np.uint16)
        words[0, : 1 << 16] = np.arange(1 << 16, dtype=np.uint16)[:n]
        return words[0].view(dtype), words[1].view(dtype)
    if dtype.kind == "f":
        bits = rng.integers(
            0, 1 << (8 * dtype.itemsize), size=(2, n), dtype=np.uint64 if dtype.itemsize == 8 else np.uint32
        )
        a, b = bits[0].view(dtype).copy(), bits[1].view(dtype).copy()
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3.0, 1e-40, 65504.0], dtype)
        a[: special.size], b[: special.size] = special, special[::-1]
        a[special.size : 2 * special.size] = rng.normal(size=special.size)  # ordinary values too
        return a, b
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    b = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    a[:4], b[:4] = [info.min, info.max, -1 if info.min else 0, 0], [info.min, 1, info.max, info.min]
    return a, b


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise equal; NaNs may differ in payload only where both are NaN (numpy's half
    conversions may run on the CPU's F16C, which quiets them)."""
    g, w = got.view(np.uint8).reshape(got.size, -1), want.view(np.uint8).reshape(want.size, -1)
    differ = np.nonzero((g != w).any(axis=1))[0]
    if differ.size and got.dtype.kind in "fV":
        as_float = np.asarray(got.astype(np.float32)), np.asarray(want.astype(np.float32))
        differ = differ[~(np.isnan(as_float[0][differ]) & np.isnan(as_float[1][differ]))]
    assert not differ.size, (
        f"{differ.size} differ, first at {differ[0]}: {got[differ[0]]!r} != {want[differ[0]]!r}"
    )


@pytest.mark.parametrize("name", list(cuda_kernels.DTYPES))
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG])
def test_cuda_contract_every_kernel_reduces_as_numpy_does(kernels, name: str, op: ReduceOp) -> None:
    dtype = DTYPES[name]
    rng = np.random.default_rng(hash((name, op.value)) & 0xFFFF)
    n = 1 << 16 if dtype.itemsize == 2 else 20_000
    a, b = _inputs(dtype, n, rng)
    out = np.empty_like(a)
    getattr(kernels, cuda_kernels.combine_name(op, name))(
        _pointer(a), _pointer(b), _pointer(out), ctypes.c_longlong(n)
    )
    want = np.empty_like(a)
    reduction = Reduction(op, dtype, 7)
    with np.errstate(all="ignore"):
        reduction.combine(a, b, want)
    _same(out, want)
    if op is ReduceOp.AVG:
        for participants in (2, 3, 7, 100):  # numpy refuses int8 // 1000
            x, want = a.copy(), a.copy()
            getattr(kernels, cuda_kernels.divide_name(name))(
                _pointer(x), ctypes.c_longlong(n), ctypes.c_longlong(participants)
            )
            with np.errstate(all="ignore"):
                Reduction(op, dtype, participants).finalize(want)
            _same(x, want)


def test_cuda_contract_float16_and_bfloat16_round_as_numpy_and_ml_dtypes(kernels) -> None:
    """The conversions alone: float32 bit patterns of every exponent, every float16
    halfway point (ties to even) and its neighbours; float16 to float32 exhaustively."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, size=400_000, dtype=np.uint32)
    ties = np.arange(1 << 16, dtype=np.uint32) << 13
    floats = np.concatenate([bits, ties | 0x1000, ties | 0x0FFF, ties | 0x1001, ties << 3]).view(np.float32)
    n = ctypes.c_longlong(floats.size)
    for name, fn in (("float16", kernels.to_f16), ("bfloat16", kernels.to_bf16)):
        got = np.empty(floats.size, np.uint16)
        fn(_pointer(floats), _pointer(got), n)
        with np.errstate(all="ignore"):
            _same(got.view(DTYPES[name]), floats.astype(DTYPES[name]))
    words = np.arange(1 << 16, dtype=np.uint16)
    back = np.empty(words.size, np.float32)
    kernels.from_f16(_pointer(words), _pointer(back), ctypes.c_longlong(words.size))
    _same(back, words.view(np.float16).astype(np.float32))


def test_cuda_contract_the_kernels_are_every_dtype_and_op_once() -> None:
    names = cuda_kernels.names()
    # per dtype: four combines, the division and four one-shot kernels (avg runs sum's)
    assert len(names) == len(set(names)) == len(cuda_kernels.DTYPES) * 9
    text = cuda_kernels.source()
    assert all(f"KERNEL void {n}(" in text for n in names)
    assert "cuda_fp16.h" not in text and "cuda_bf16.h" not in text  # NVRTC needs no header


CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_cuda_contract_the_cuda_source_is_well_formed_cuda_cpp(tmp_path) -> None:
    """What NVRTC will compile (CUDA's prelude: extern "C" __global__ kernels, device
    intrinsics), parsed as C++ with CUDA's keywords and built-ins declared: a typo in the
    part the host build does not see fails here, not on the first GPU."""
    shim = """
#define __global__
#define __device__
#define __forceinline__ inline
struct lpsync_dim { unsigned int x; };
static lpsync_dim blockIdx, threadIdx, blockDim, gridDim;
float __uint_as_float(unsigned int);
unsigned int __float_as_uint(float);
"""
    source = tmp_path / "kernels.cu.cpp"
    source.write_text(shim + cuda_kernels.source())
    assert CXX is not None
    subprocess.run([CXX, "-fsyntax-only", "-Wall", "-Werror", "-x", "c++", str(source)], check=True)
