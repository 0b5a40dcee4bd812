"""Small multi-node collectives: which ones ride the agreement, and what each node brings.

A collective of at most SMALL_MAX_BYTES (nccl-tests' size) needs no schedule of its own:
each node folds its local ranks' inputs into one part, the parts travel up the
agreement's tree with the summaries (folded at every hop), node 0 finishes the result
and it travels down with the verdict (ride.py: what the data does on the way). One
message per tree edge each way, where agreement then a schedule would pay twice the
hops; measured on 8 emulated nodes (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from lpsync.daemon.collectives.ride import AT_ROOT, END_TO_END, FROM_ROOT, SMALL_MAX_BYTES, Ride
from lpsync.daemon.collectives.staging import whole
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival
from lpsync.types import Collective

__all__ = ["SMALL_MAX_BYTES", "rides", "riding"]


def rides(task: Task) -> bool:
    """Whether this collective's data rides the agreement: small, and no algorithm forced
    (a forced one runs as asked). Decided from the spec alone, so nodes that agree on the
    spec decide alike."""
    if task.op in (Collective.BARRIER, Collective.ALLTOALL) or task.spec.algorithm:
        return False  # all-to-all's parts would carry every block to node 0 and back
    return task.nbytes <= SMALL_MAX_BYTES


@contextlib.contextmanager
def riding(task: Task, devices: DeviceRegistry | None, deadline: float) -> Iterator[Ride | None]:
    """The collective that rides the agreement (None: a barrier, nothing rides): on host
    buffers as they are, on devices staged through host mirrors while it runs (written
    back as the block ends)."""
    if task.op is Collective.BARRIER:
        yield None
        return
    with whole(task, devices, deadline) as hosts:  # host buffers: the arrivals themselves
        yield _ride(task, hosts)


def _ride(task: Task, arrivals: list[Arrival]) -> Ride:
    """This node's Ride: ``arrivals`` are its participants (host arrays), in rank order.
    Its part: its ranks' inputs reduced (reducing ops), laid end to end (allgather,
    gather), or the root's input (broadcast, scatter; empty on other nodes)."""
    op, root = task.op, task.spec.root
    reducing = reduction(task.spec, task.dtype, task.participants)
    ranks: list[int] = []
    views: list = []  # host arrays (device spans were staged), typed below without a call
    for a in arrivals:  # a loop, no comprehension's frame: one is made per collective
        ranks.append(a.rank)
        views.append(buffers(task.spec, a, task.participants))
    # The ranks in the order their allgather blocks are folded (node by node); None when
    # that is rank order (node-major ranks).
    layout = task.job.layout
    order = None if layout is None or layout.node_major else list(layout.by_node)
    own = None  # the accumulator this node allocates (reducing ops)
    if op in FROM_ROOT:
        part = views[ranks.index(root)][0] if root in ranks else np.empty(0, task.dtype)
    elif op in END_TO_END:
        part = np.concatenate([inp for inp, _ in views])
    else:
        part = own = views[0][0].copy()
        assert reducing is not None  # the reducing ops are what is left
        for inp, _ in views[1:]:
            reducing.combine(part, inp, part)
    return Ride(
        op=op,
        root=root,
        count=task.spec.count,
        dtype=task.dtype,
        ranks=ranks,
        buffers=views,
        reduction=reducing,
        order=order,
        part=part,
        everywhere=op not in AT_ROOT,
        own=own,
    )
