"""The torch backend's staging: flat buffers a collective's tensors are copied through,
pooled per process group by exact byte size (shared memory of the group's daemon session,
or one device's memory registered by IPC handle), and one call's piece of such a buffer."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from lpsync_client import _adapt
from lpsync_client.client import Client
from lpsync_client.errors import LpsyncError
from lpsync_client.torch._client import Where, empty_on

# The dtypes the backend moves, and the numpy view the client takes of each (None:
# bfloat16, which numpy lacks, goes as a torch view).
DTYPES = {
    torch.float16: np.float16,
    torch.bfloat16: None,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.uint8,
}


class StagingPool:
    """Shared-memory arrays of the group's daemon session, by exact byte size. An array is
    owned by one collective from acquire() until release(); free ones are reused most
    recently used first and released to the daemon beyond STAGING_BYTES."""

    where: Where | None = None  # host memory

    def __init__(self, client: Client, budget: int) -> None:
        self._client, self._budget = client, budget
        self._free: OrderedDict[int, Any] = OrderedDict()  # id -> array, LRU order
        self._free_bytes = 0
        self._lock = threading.Lock()
        # Each pooled buffer's typed views, made once (dropped with the buffer): the client
        # then sees the same operand object call after call, which its prepared request
        # (and the plan the daemon armed) is found by without a lookup of the address.
        self._views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, Any]] = {}

    def views(self, raw: Any, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """(a typed flat torch view, what the client takes) of ``raw``, a buffer of this
        pool owned by the caller: see Staged."""
        key = (id(raw), dtype)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = _typed(raw, dtype, self.where is not None)
        return found

    def acquire(self, nbytes: int) -> Any:
        with self._lock:
            for key in reversed(self._free):
                if self._free[key].nbytes == nbytes:
                    self._free_bytes -= nbytes
                    return self._free.pop(key)
        return self._new(nbytes)

    def _new(self, nbytes: int) -> Any:
        return self._client.empty(nbytes, "uint8")

    def release(self, array: Any) -> None:
        evicted = []
        with self._lock:
            self._free[id(array)] = array
            self._free_bytes += array.nbytes
            while self._free_bytes > self._budget and self._free:
                _, old = self._free.popitem(last=False)
                self._free_bytes -= old.nbytes
                evicted.append(old)
                for dtype in DTYPES:
                    self._views.pop((id(old), dtype), None)
        for old in evicted:
            # The session may be gone: then the daemon has freed it already.
            with contextlib.suppress(LpsyncError):
                self._client.release(old)


class DevicePool(StagingPool):
    """The same in one device's memory: flat uint8 tensors registered by IPC handle, each
    registration tied to its tensor (it goes when the tensor is dropped)."""

    def __init__(self, client: Client, budget: int, where: Where) -> None:
        super().__init__(client, budget)
        self.where = where

    def _new(self, nbytes: int) -> torch.Tensor:
        assert self.where is not None
        raw = empty_on(self.where, nbytes, torch.uint8)
        _adapt.ensure_registered(self._client, raw)
        return raw


def _typed(raw: Any, dtype: torch.dtype, on_device: bool) -> tuple[torch.Tensor, Any]:
    """``raw`` (a pool's buffer) as a flat torch tensor of ``dtype``, and as the client takes
    it (see Staged)."""
    if on_device:
        flat = raw.view(dtype)
        return flat, flat.view(torch.uint8) if dtype == torch.bool else flat
    flat = torch.from_numpy(raw).view(dtype)
    np_dtype = DTYPES[dtype]
    return flat, flat if np_dtype is None else raw.view(np_dtype)


class Staged:
    """One tensor's staging: a typed flat torch view of a pool buffer, and what the client
    takes (in shared memory: numpy, or a torch view for bfloat16, which numpy lacks; on a
    device: the torch view, bool as its uint8 bytes)."""

    def __init__(self, pool: StagingPool, dtype: torch.dtype, numel: int) -> None:
        self.pool = pool
        self.raw = pool.acquire(numel * dtype.itemsize)
        self.flat, self.operand = pool.views(self.raw, dtype)

    def give_back(self) -> None:
        """Return the buffer to its pool. CUDA: after the copies out that this thread queued
        on its stream, so the work completes with its tensors written and the next user of
        the buffer cannot overwrite it first."""
        where = self.pool.where
        if where is not None and where[0] == "cuda":
            torch.cuda.current_stream(where[1]).synchronize()
        self.pool.release(self.raw)
