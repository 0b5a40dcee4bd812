"""A matched collective as every later stage reads it.

matching.py ends the "matched" stage when every local participant has arrived; ``Task``
takes the facts each stage needs from the Pending collective once (op, element type,
size, this node's participants, the timeout) so that no stage derives them again. It
then moves forward through path.py: agreed (multi-node) -> planned -> staged -> run ->
finished, each stage a module of its own that reads the Task and hands its result on.
"""

from __future__ import annotations

import functools
import time
import zlib
from dataclasses import dataclass

import numpy as np

from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.views import nccl_bytes
from lpsync.daemon.values import Arrival, Pending, Spec
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.types import COLLECTIVE_OF, Collective, dtype_of

_NO_DATA = np.dtype(np.uint8)  # a barrier's: it moves no data (count 0)
# A collective's message tags (planning.tag_base): job hash | sequence | STEP_BITS of steps.
STEP_BITS = 20


@functools.lru_cache(maxsize=1024)
def job_hash(name: str) -> int:
    """A job's name as a number: what its messages' tags are made of."""
    return zlib.crc32(name.encode())


@dataclass(slots=True)
class Task:
    """Read-only once made (not frozen: one is made per collective, and a frozen
    dataclass costs four times as much to make)."""

    job: Job
    pending: Pending
    spec: Spec
    op: Collective
    dtype: np.dtype
    participants: int  # the job's world size (every node's ranks)
    nbytes: int  # nccl-tests' size of the collective
    arrivals: list[Arrival]  # this node's participants, in rank order
    timeout: float  # seconds: the shortest timeout any local participant gave
    on_device: bool  # device spans (every participant), or host arrays (every one)
    start: float  # time.perf_counter() when the task left matching

    @classmethod
    def matched(cls, job: Job, pending: Pending) -> Task:
        spec = pending.spec
        op = COLLECTIVE_OF[spec.op]
        dtype = _NO_DATA if op is Collective.BARRIER else dtype_of(spec.dtype)
        arrivals = [pending.arrivals[r] for r in job.local_ranks]
        device = [isinstance(a.data, Span) for a in arrivals]
        if any(device) and not all(device):
            raise InvalidArgumentError(
                "every participant of a collective must pass device buffers, or none: ranks "
                f"{[a.rank for a, d in zip(arrivals, device, strict=True) if not d]} passed host memory"
            )
        return cls(
            job=job,
            pending=pending,
            spec=spec,
            op=op,
            dtype=dtype,
            participants=job.world_size,
            nbytes=nccl_bytes(op, spec.count, dtype.itemsize, job.world_size),
            arrivals=arrivals,
            timeout=min(a.timeout for a in arrivals),
            on_device=any(device),
            start=time.perf_counter(),
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
