"""A matched collective as every later stage reads it.

matching.py ends the "matched" stage when every local participant has arrived; ``Task``
takes the facts each stage needs from the Pending collective once (op, element type,
size, this node's participants, the timeout) so that no stage derives them again. It
then moves forward through path.py: agreed (multi-node) -> planned -> staged -> run ->
finished, each stage a module of its own that reads the Task and hands its result on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.views import facts
from lpsync.daemon.values import Arrival, Pending, Spec
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span
from lpsync.types import Collective


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
        spec, arrivals = pending.spec, pending.arrivals
        op, dtype, nbytes, _ = facts(spec, job.world_size)
        mine = list(map(arrivals.__getitem__, job.local_ranks))  # no comprehension's frame
        timeout, devices = mine[0].timeout, 0
        for arrival in mine:  # one loop, no generators: this runs for every collective
            timeout = min(timeout, arrival.timeout)
            devices += isinstance(arrival.data, Span)
        if devices and devices != len(mine):
            hosts = [a.rank for a in mine if not isinstance(a.data, Span)]
            raise InvalidArgumentError(
                "every participant of a collective must pass device buffers, or none: ranks "
                f"{hosts} passed host memory"
            )
        return cls(
            job=job,
            pending=pending,
            spec=spec,
            op=op,
            dtype=dtype,
            participants=job.world_size,
            nbytes=nbytes,
            arrivals=mine,
            timeout=timeout,
            on_device=devices > 0,
            start=time.perf_counter(),
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
