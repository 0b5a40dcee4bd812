"""Run every participant of a schedule in this process: one thread each (a lone participant
runs on the caller's thread), inproc transport.

Used by the tests and benchmarks today, and by the daemon for the participants that
share its node. ``layout`` says which arrays a participant passes for an op, in place
or not, so that callers never repeat the per-op buffer rules.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from lpsync.algorithms.schedule import Schedule
from lpsync.engine.buffers import HOST, Buffers
from lpsync.engine.endpoint import Endpoint
from lpsync.engine.executor import Plan, deadline_after
from lpsync.engine.routing import Placement, RoutedEndpoint
from lpsync.errors import AbortedError, InvalidArgumentError, LpsyncError
from lpsync.reduction import Reduction
from lpsync.transport.inproc import InprocFabric
from lpsync.types import Collective, blocks

if TYPE_CHECKING:
    from lpsync.memory.kind import Span


@overload
def layout(
    op: Collective,
    rank: int,
    participants: int,
    count: int,
    data: np.ndarray,
    in_place: bool,
    root: int = 0,
) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def layout(
    op: Collective,
    rank: int,
    participants: int,
    count: int,
    data: Span,
    in_place: Literal[True],
    root: int = 0,
) -> tuple[Span, Span]: ...


def layout(
    op: Collective,
    rank: int,
    participants: int,
    count: int,
    data: np.ndarray | Span,
    in_place: bool,
    root: int = 0,
) -> tuple[np.ndarray | Span, np.ndarray | Span]:
    """(IN, OUT) for one participant (sizes: lpsync_client.wire.blocks).

    Out of place, ``data`` is the input and a new OUT is allocated. In place, ``data``
    is the one buffer, as large as the larger side: the input and the result of
    allreduce/broadcast/reduce (a non-root's buffer is left as it was by reduce); where
    the sides differ (allgather, reduce_scatter, gather, scatter) the smaller side is the
    rank's own block of it, at rank*count (or nothing: a gather's non-root output, a
    scatter's non-root input).
    """
    n_in, n_out = blocks(op, participants, rank, root)
    if not in_place:
        return data, np.empty(count * n_out, data.dtype)
    if n_in == n_out:
        return data, data
    block = data[rank * count : (rank + 1) * count] if min(n_in, n_out) == 1 else data[:0]
    return (block, data) if n_in < n_out else (data, block)


class LocalGroup:
    """This node's participants of ``schedule`` bound to their buffers; ``run`` as often as needed.

    Without ``placement`` every participant is here and ``buffers`` lists them all in rank
    order. With it (a multi-node collective) ``buffers`` lists the node's own participants
    (``placement.local_ranks``) and ``remote`` is the node-level Endpoint that reaches the
    other nodes (lpsync.engine.routing). ``memory``: what the buffers are (host arrays, or
    device spans: lpsync.engine.buffers), for every participant or one per participant.
    """

    def __init__(
        self,
        schedule: Schedule,
        buffers: Sequence[tuple[np.ndarray, np.ndarray]],
        reduction: Reduction | None,
        placement: Placement | None = None,
        remote: Endpoint | None = None,
        memory: Buffers | Sequence[Buffers] = HOST,
    ) -> None:
        if (placement is None) != (remote is None):
            raise InvalidArgumentError("a placement and a remote endpoint go together")
        ranks = placement.local_ranks if placement is not None else list(range(len(buffers)))
        if len(ranks) != len(buffers):
            raise InvalidArgumentError(f"{len(buffers)} buffers for {len(ranks)} local participants")
        self.schedule, self.placement, self.remote = schedule, placement, remote
        memories = list(memory) if isinstance(memory, Sequence) else [memory] * len(ranks)
        self.plans = [
            Plan(schedule, r, bufs, reduction, mem)
            for r, bufs, mem in zip(ranks, buffers, memories, strict=True)
        ]
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self.plans)), thread_name_prefix="lpsync-local"
        )
        self.nbytes = sum(plan.nbytes for plan in self.plans)  # scratch held while cached

    def _endpoint(self, fabric: InprocFabric, rank: int) -> Endpoint:
        if self.placement is None or self.remote is None:
            return fabric.endpoint(rank)
        return RoutedEndpoint(rank, self.placement, fabric.endpoint(rank), self.remote)

    def run(self, timeout: float, tag_base: int = 0) -> None:
        """Run once; the first participant to fail aborts the others and its error is raised.

        ``tag_base`` keeps the messages of successive collectives apart on a transport
        that outlives them (the inter-node one).
        """
        fabric = InprocFabric(self.schedule.participants)
        deadline = deadline_after(timeout)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def participant(plan: Plan) -> None:
            try:
                plan.run(self._endpoint(fabric, plan.rank), deadline, tag_base)
            except BaseException as error:  # any failure must release the others at once
                with lock:
                    errors.append(error)
                fabric.abort(
                    error
                    if isinstance(error, LpsyncError)
                    else LpsyncError(f"rank {plan.rank} failed: {error!r}")
                )

        if len(self.plans) == 1:  # nobody to run alongside: no hand-off to a pool thread
            participant(self.plans[0])
        else:
            for future in [self._pool.submit(participant, plan) for plan in self.plans]:
                future.result()
        if errors:
            first = next((e for e in errors if not isinstance(e, AbortedError)), errors[0])
            raise first

    def close(self, wait: bool = True) -> None:
        """``wait=False``: the threads end on their own once a running schedule finishes
        (the daemon's event loop must never wait for one)."""
        self._pool.shutdown(wait=wait)

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
