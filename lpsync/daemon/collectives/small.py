"""Small multi-node collectives: their data rides the agreement's messages (agreement.py).

A collective of at most SMALL_MAX_BYTES (nccl-tests' size) needs no schedule of its own:
each node folds its local ranks' inputs into one part, the parts travel up the
agreement's tree with the summaries (folded at every hop), node 0 finishes the result
and it travels down with the verdict. One message per tree edge each way, where agreement
then a schedule would pay twice the hops; measured on 8 emulated nodes (docs/benchmarks.md).

Parts are folded in node order, own part first (a subtree of the binomial tree is a
contiguous run of nodes whose children come in ascending order), so allgather blocks
come node by node: rank order where ranks are node-major, else write() puts each block
at its rank's place; every node takes node 0's one result, so all get the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from lpsync.daemon.collectives.staging import whole
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival
from lpsync.types import Collective

# Up to this size the data rides the agreement (a 64 KiB broadcast on 8 nodes: see
# docs/benchmarks.md); the same constant on every node, so all decide alike.
SMALL_MAX_BYTES = 64 * 1024
_FROM_ROOT = frozenset({Collective.BROADCAST, Collective.SCATTER})  # the root's input is the result
_END_TO_END = frozenset({Collective.ALLGATHER, Collective.GATHER})  # every rank's block, in order
_AT_ROOT = frozenset({Collective.REDUCE, Collective.GATHER})  # only the root's output is written


def rides(task: Task) -> bool:
    """Whether this collective's data rides the agreement: small, and no algorithm forced
    (a forced one runs as asked). Decided from the spec alone, so nodes that agree on the
    spec decide alike."""
    if task.op in (Collective.BARRIER, Collective.ALLTOALL) or task.spec.algorithm:
        return False  # all-to-all's parts would carry every block to node 0 and back
    return task.nbytes <= SMALL_MAX_BYTES


@contextlib.contextmanager
def riding(task: Task, devices: DeviceRegistry | None, deadline: float) -> Iterator[SmallCollective | None]:
    """The collective that rides the agreement (None: a barrier, nothing rides): on host
    buffers as they are, on devices staged through host mirrors while it runs (written
    back as the block ends)."""
    if task.op is Collective.BARRIER:
        yield None
        return
    with whole(task, devices, deadline) as hosts:  # host buffers: the arrivals themselves
        yield SmallCollective(task, hosts)


class SmallCollective:
    """One node's side of a riding collective: its part, folding, and writing results.

    ``arrivals`` are this node's participants (host arrays: device buffers are staged
    first), in rank order."""

    # One is made per small collective: no instance dict.
    __slots__ = (
        "_own",
        "buffers",
        "count",
        "dtype",
        "everywhere",
        "op",
        "order",
        "part",
        "ranks",
        "reduction",
        "root",
    )

    def __init__(self, task: Task, arrivals: list[Arrival]) -> None:
        self.op, self.root, self.count, self.dtype = task.op, task.spec.root, task.spec.count, task.dtype
        # Whether every node needs the result (reduce and gather: only the root's node).
        self.everywhere = self.op not in _AT_ROOT
        self.ranks: list[int] = []
        views: list = []  # host arrays (device spans were staged), typed below without a call
        for a in arrivals:  # a loop, no comprehension's frame: one is made per collective
            self.ranks.append(a.rank)
            views.append(buffers(task.spec, a, task.participants))
        self.buffers: list[tuple[np.ndarray, np.ndarray]] = views
        # The ranks in the order their allgather blocks are folded (node by node); None
        # when that is rank order (node-major ranks).
        layout = task.job.layout
        self.order = None if layout is None or layout.node_major else list(layout.by_node)
        self.reduction = reduction(task.spec, self.dtype, task.participants)
        # The accumulator this node allocated: the only array a reduction may write into
        # (never a participant's input, nor a received message's buffer).
        self._own: np.ndarray | None = None
        # What this node sends up the agreement, made once here (agreement.py reads it).
        self.part = self._part()

    def _part(self) -> np.ndarray:
        """This node's contribution: its ranks' inputs reduced (reducing ops), laid end to
        end (allgather, gather), or the root's input (broadcast, scatter; empty on other
        nodes)."""
        if self.op in _FROM_ROOT:
            if self.root in self.ranks:
                return self.buffers[self.ranks.index(self.root)][0]
            return np.empty(0, self.dtype)
        if self.op in _END_TO_END:
            return np.concatenate([inp for inp, _ in self.buffers])
        part = self._own = self.buffers[0][0].copy()
        for inp, _ in self.buffers[1:]:
            assert self.reduction is not None  # the reducing ops are what is left
            self.reduction.combine(part, inp, part)
        return part

    def fold(self, acc: np.ndarray, part: np.ndarray) -> np.ndarray:
        """``acc`` (the nodes before) with ``part`` (the next nodes) folded in; acc may be
        reused as the result."""
        if self.op in _FROM_ROOT:
            return acc if acc.size else part
        if self.op in _END_TO_END:
            return np.concatenate((acc, part))
        if part.shape != acc.shape:
            raise ValueError(f"a part of {part.size} elements where {acc.size} were expected")
        if acc is not self._own:
            acc = self._own = acc.copy()
        assert self.reduction is not None  # the reducing ops are what is left
        self.reduction.combine(acc, part, acc)
        return acc

    def finish(self, acc: np.ndarray) -> np.ndarray:
        """The result from every node's folded parts (node 0 in the tree, every node in
        an exchange)."""
        if self.reduction is not None:
            acc = acc if acc is self._own else acc.copy()
            self.reduction.finalize(acc)
        return acc

    def write(self, result: np.ndarray) -> None:
        """Each local participant's output from the result (a non-root's buffer of reduce
        or gather is never written)."""
        for rank, (_, out) in zip(self.ranks, self.buffers, strict=True):
            if self.op in _AT_ROOT and rank != self.root:
                continue  # its node may have had the verdict alone: no result
            if self.op is Collective.REDUCE:
                np.copyto(out, result)
            elif self.op in (Collective.REDUCE_SCATTER, Collective.SCATTER):
                block = result[rank * self.count : (rank + 1) * self.count]
                if not np.shares_memory(out, block):
                    np.copyto(out, block)
            elif self.op in _END_TO_END and self.order is not None:
                # Blocks came node by node: put each at its rank's place.
                out.reshape(len(self.order), self.count)[self.order] = result.reshape(
                    len(self.order), self.count
                )
            # Only a root's own input (broadcast in place) can be the result itself.
            elif self.op not in _FROM_ROOT or not np.shares_memory(out, result):
                out[...] = result
