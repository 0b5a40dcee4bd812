"""Allreduce of many small arrays as one collective per dtype (gradient fusion): the
arrays are packed into a shared-memory buffer kept per client and dtype (registered once,
grown when needed), reduced in place, and handed back as views of that buffer. Used by the
jax and cupy adapters, whose arrays the daemon cannot map."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import numpy as np

from lpsync_client.client import Client

# client -> dtype name -> its fusion buffer (numpy, in shared memory)
_buffers: weakref.WeakKeyDictionary[Client, dict[str, np.ndarray]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # one fused call at a time per process: they share the buffers


def _buffer(client: Client, dtype: np.dtype, count: int) -> np.ndarray:
    held = _buffers.setdefault(client, {})
    key = dtype.name if dtype.name != "void" else str(dtype)
    buffer = held.get(key)
    if buffer is None or buffer.size < count:
        if buffer is not None:
            client.release(buffer)
        buffer = client.empty(max(count, 1), dtype)
        held[key] = buffer
    return buffer


def allreduce(
    client: Client, arrays: list[np.ndarray], op: str, *, name: str = "", timeout: float | None = None
) -> list[np.ndarray]:
    """Reduce every array over the job's ranks; the results as copies, in order."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    results: list[np.ndarray] = [np.empty(0)] * len(arrays)
    with _lock:
        pending: list[tuple[Future, np.ndarray, list[int]]] = []
        # Every rank flattens the same tree: the dtype groups come in the same order.
        for dtype, indices in by_dtype.items():
            count = sum(arrays[i].size for i in indices)
            packed = _buffer(client, dtype, count)[:count]
            offset = 0
            for i in indices:
                packed[offset : offset + arrays[i].size] = arrays[i].reshape(-1)
                offset += arrays[i].size
            pending.append(
                (
                    client.allreduce_async(
                        packed, op=op, timeout=timeout, name=f"{name}/{dtype}" if name else ""
                    ),
                    packed,
                    indices,
                )
            )
        for future, packed, indices in pending:
            client._wait(future, timeout)
            offset = 0
            for i in indices:
                results[i] = packed[offset : offset + arrays[i].size].reshape(arrays[i].shape).copy()
                offset += arrays[i].size
    return results
