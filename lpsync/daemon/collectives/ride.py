"""A small collective's data on its ride through the agreement (agreement.py).

small.py decides which collectives ride and makes each node's ``Ride``: its part (its
ranks' inputs folded) and its participants' host views. This module is what the data
does on the way: the agreement folds the parts as they travel up its tree (``folded``,
in node order: a subtree of the binomial tree is a contiguous run of nodes whose
children come in ascending order) and node 0 finishes the result; the finish stage
(finish.py) writes it into each local participant's output (``write``). Allgather
blocks come node by node: rank order where ranks are node-major, else ``write`` puts
each block at its rank's place; every node takes node 0's one result, so all get the
same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lpsync.reduction import Reduction
from lpsync.types import Collective

# Up to this size the data rides the agreement (a 64 KiB broadcast on 8 nodes: see
# docs/benchmarks.md); the same constant on every node, so all decide alike. The
# agreement sizes its receive buffers by it.
SMALL_MAX_BYTES = 64 * 1024
FROM_ROOT = frozenset({Collective.BROADCAST, Collective.SCATTER})  # the root's input is the result
END_TO_END = frozenset({Collective.ALLGATHER, Collective.GATHER})  # every rank's block, in order
AT_ROOT = frozenset({Collective.REDUCE, Collective.GATHER})  # only the root's output is written


@dataclass(slots=True)
class Ride:
    """One node's side of a riding collective (small.riding makes it; slots: one is made
    per small collective). ``buffers`` are this node's participants' (input, output) host
    views (device buffers were staged), in rank order."""

    op: Collective
    root: int
    count: int
    dtype: np.dtype
    ranks: list[int]
    buffers: list[tuple[np.ndarray, np.ndarray]]
    reduction: Reduction | None
    order: list[int] | None  # the ranks in allgather blocks' order; None: rank order
    part: np.ndarray  # what this node sends up the agreement
    everywhere: bool  # every node needs the result (reduce and gather: the root's node)
    # The accumulator this node allocated: the only array a reduction may write into
    # (never a participant's input, nor a received message's buffer).
    own: np.ndarray | None

    def folded(self, parts: list[np.ndarray], finish: bool) -> np.ndarray:
        """``parts`` (contiguous runs of nodes, in node order) folded into one; ``finish``:
        the result from every node's parts (node 0 in the tree, every node in an
        exchange). The first part may be reused as the result."""
        acc = parts[0]
        for part in parts[1:]:
            acc = self._fold(acc, part)
        if finish and self.reduction is not None:
            acc = acc if acc is self.own else acc.copy()
            self.reduction.finalize(acc)
        return acc

    def _fold(self, acc: np.ndarray, part: np.ndarray) -> np.ndarray:
        if self.op in FROM_ROOT:
            return acc if acc.size else part
        if self.op in END_TO_END:
            return np.concatenate((acc, part))
        if part.shape != acc.shape:
            raise ValueError(f"a part of {part.size} elements where {acc.size} were expected")
        if acc is not self.own:
            acc = self.own = acc.copy()
        assert self.reduction is not None  # the reducing ops are what is left
        self.reduction.combine(acc, part, acc)
        return acc

    def write(self, result: np.ndarray) -> None:
        """Each local participant's output from the result (a non-root's buffer of reduce
        or gather is never written)."""
        for rank, (_, out) in zip(self.ranks, self.buffers, strict=True):
            if self.op in AT_ROOT and rank != self.root:
                continue  # its node may have had the verdict alone: no result
            if self.op is Collective.REDUCE:
                np.copyto(out, result)
            elif self.op in (Collective.REDUCE_SCATTER, Collective.SCATTER):
                block = result[rank * self.count : (rank + 1) * self.count]
                if not np.shares_memory(out, block):
                    np.copyto(out, block)
            elif self.op in END_TO_END and self.order is not None:
                # Blocks came node by node: put each at its rank's place.
                out.reshape(len(self.order), self.count)[self.order] = result.reshape(
                    len(self.order), self.count
                )
            # Only a root's own input (broadcast in place) can be the result itself.
            elif self.op not in FROM_ROOT or not np.shares_memory(out, result):
                out[...] = result
