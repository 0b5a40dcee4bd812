"""Seeing a user's tensor as a writable 1-D numpy view, with its lpsync dtype name.

Accepted: numpy arrays, torch CPU tensors, anything with ``__dlpack__``, anything with
the buffer protocol. bfloat16 torch tensors are viewed as uint16 bits with dtype name
"bfloat16" so the client needs no ml_dtypes.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from lpsync_client.errors import InvalidArgumentError

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8")


_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    name = np.dtype(dtype).name
    if name in DTYPES:
        _NAMES[dtype] = name
    else:
        raise InvalidArgumentError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidArgumentError(
                "bfloat16 arrays need ml_dtypes (pip install 'lpsync-client[bfloat16]')"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    if name not in DTYPES:
        raise InvalidArgumentError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return np.dtype(name)


def as_numpy(x: object) -> tuple[np.ndarray, str]:
    """(a C-contiguous 1-D view sharing x's memory, dtype name)."""
    arr: np.ndarray
    name = ""
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the hot path
        return x.reshape(-1), dtype_name(x.dtype)
    if isinstance(x, np.ndarray):
        arr = x
    elif type(x).__module__.startswith("torch"):
        import torch

        t = cast(torch.Tensor, x)  # the torch objects passed here are tensors (Tensor, Parameter)
        if t.device.type != "cpu":
            raise InvalidArgumentError("only CPU tensors can be registered in this version")
        if t.dtype == torch.bfloat16:
            arr, name = t.detach().view(torch.int16).numpy().view(np.uint16), "bfloat16"
        else:
            arr = t.detach().numpy()
    elif hasattr(x, "__dlpack__"):
        arr = np.from_dlpack(x)
    else:
        try:
            arr = np.asarray(memoryview(x))  # type: ignore[arg-type]
        except TypeError:
            raise InvalidArgumentError(
                f"cannot use {type(x).__name__}: pass a numpy array, a torch CPU tensor, or "
                "an object with __dlpack__ or the buffer protocol"
            ) from None
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("the array must be C-contiguous")
    return arr.reshape(-1), name or dtype_name(arr.dtype)
