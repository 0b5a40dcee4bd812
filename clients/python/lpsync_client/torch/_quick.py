"""The torch backend's quick path: a small synchronous op (torch waits for its work at
once) on contiguous host tensors, run on the caller's thread with nothing made per call.

Its staging is the group's pooled buffer of that exact size (the same one call after
call while nothing else takes it) and that buffer's views made once (StagingPool.views),
so the client's blocking call finds its prepared request by the operand itself, and once
the daemon armed the plan it rings the job's doorbell and is answered on this thread
(lpsync_client._hot: no Future, no protobuf, no socket). The work returned is complete.
Anything else (async ops, device, sparse, strided or larger tensors, coalesced groups,
zero elements) takes the general way: Piecewise ops through _runner.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lpsync_client.client import Client
from lpsync_client.torch._client import device_of
from lpsync_client.torch._pieces import buffer_limit
from lpsync_client.torch._staging import DTYPES, StagingPool

# A synchronous op staging at most this many bytes is answered on the caller's thread
# (larger ones are split into pieces meant to be in flight together).
ANSWER_HERE_BYTES = 1 << 20


class Quick:
    """The quick path of one process group: ``fits`` says whether a call takes it, ``run``
    stages it and lets the op's copies and blocking collective run on the staging."""

    def __init__(self, client: Client, pool: StagingPool, staging_bytes: int) -> None:
        self._client, self._pool = client, pool
        self._most = min(ANSWER_HERE_BYTES, staging_bytes)

    def fits(self, opts: Any, tensors: Sequence[torch.Tensor], nbytes: int) -> bool:
        """A synchronous call (``opts.asyncOp`` False) staging 1 to ANSWER_HERE_BYTES bytes
        (within the staging budget and the daemon's buffer limit: one piece) of contiguous
        host tensors (not sparse, not emulated device memory) of a dtype the backend moves."""
        if opts is None or opts.asyncOp or not 0 < nbytes <= self._most:
            return False
        limit = buffer_limit(self._client)
        if limit is not None and nbytes > limit:
            return False
        return all(
            t.device.type == "cpu"
            and not t.is_sparse
            and t.dtype in DTYPES
            and t.is_contiguous()
            and device_of(t) is None
            for t in tensors
        )

    def run(self, dtype: torch.dtype, numel: int, call: Callable[[torch.Tensor, Any], object]) -> None:
        """``call(flat, operand)`` on a staging of ``numel`` elements of ``dtype`` (flat: the
        torch view the op copies through; operand: what the client takes), given back
        after it, also when it raises."""
        raw = self._pool.acquire(numel * dtype.itemsize)
        try:
            flat, operand = self._pool.views(raw, dtype)
            call(flat, operand)
        finally:
            self._pool.release(raw)
