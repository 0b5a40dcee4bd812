"""Run every participant of a schedule in this process: one thread each, inproc transport.

Used by the tests and benchmarks today, and by the daemon for the participants that
share its node. ``layout`` says which arrays a participant passes for an op, in place
or not, so that callers never repeat the per-op buffer rules.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lpsync.algorithms.schedule import Schedule
from lpsync.engine.executor import Plan, deadline_after
from lpsync.engine.reduce import Reduction
from lpsync.errors import AbortedError, LpsyncError
from lpsync.transport.inproc import InprocFabric
from lpsync.types import Collective


def layout(op: Collective, rank: int, participants: int, count: int, data: np.ndarray,
           in_place: bool) -> tuple[np.ndarray, np.ndarray]:
    """(IN, OUT) for one participant.

    Out of place, ``data`` is the input and a new OUT is allocated. In place, ``data``
    is the one buffer: the input and the result of allreduce/broadcast/reduce (a
    non-root's buffer is left as it was by reduce); for allgather it is the P*count
    output holding the rank's block at rank*count; for reduce_scatter the P*count input
    whose block rank*count receives the result.
    """
    if not in_place:
        size = count * participants if op is Collective.ALLGATHER else count
        return data, np.empty(size, data.dtype)
    block = slice(rank * count, (rank + 1) * count)
    if op is Collective.ALLGATHER:
        return data[block], data
    if op is Collective.REDUCE_SCATTER:
        return data, data[block]
    return data, data


class LocalGroup:
    """All participants of ``schedule`` bound to their buffers; ``run`` as often as needed."""

    def __init__(self, schedule: Schedule, buffers: Sequence[tuple[np.ndarray, np.ndarray]],
                 reduction: Reduction | None) -> None:
        self.schedule = schedule
        self.plans = [Plan(schedule, r, bufs, reduction) for r, bufs in enumerate(buffers)]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.plans)),
                                        thread_name_prefix="lpsync-local")

    def run(self, timeout: float) -> None:
        """Run once; the first participant to fail aborts the others and its error is raised."""
        fabric = InprocFabric(len(self.plans))
        deadline = deadline_after(timeout)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def participant(plan: Plan) -> None:
            try:
                plan.run(fabric.endpoint(plan.rank), deadline)
            except BaseException as error:  # any failure must release the others at once
                with lock:
                    errors.append(error)
                fabric.abort(error if isinstance(error, LpsyncError)
                             else LpsyncError(f"rank {plan.rank} failed: {error!r}"))

        for future in [self._pool.submit(participant, plan) for plan in self.plans]:
            future.result()
        if errors:
            first = next((e for e in errors if not isinstance(e, AbortedError)), errors[0])
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
