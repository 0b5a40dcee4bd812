"""A collective's buffers as the engine sees them, and its size as nccl-tests counts it.

The bottom of collectives/: every stage reads a participant's (input, output) views and
the collective's size the same way, from here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from lpsync.algorithms.cost import busbw_factor
from lpsync.daemon.values import Arrival, Spec
from lpsync.engine.group import layout
from lpsync.reduction import Reduction
from lpsync.types import BLOCKED, COLLECTIVE_OF, REDUCE_OP_OF, Collective, dtype_of

if TYPE_CHECKING:
    from lpsync.memory.kind import Span

REDUCING = frozenset({Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER})


_NO_DATA = np.dtype(np.uint8)  # a barrier's: it moves no data (count 0)


class Facts(NamedTuple):
    """What a collective's Spec implies in a job of ``participants`` ranks (views.facts)."""

    op: Collective
    dtype: np.dtype
    nbytes: int  # nccl-tests' size
    bus: float  # nccl-tests' bus bandwidth factor


@functools.lru_cache(maxsize=1024)
def facts(spec: Spec, participants: int) -> Facts:
    """The Facts of ``spec`` (a checked request's), worked out once: a job repeats its
    collectives, and the matched collective and its record both read them."""
    op = COLLECTIVE_OF[spec.op]
    dtype = _NO_DATA if op is Collective.BARRIER else dtype_of(spec.dtype)
    nbytes = nccl_bytes(op, spec.count, dtype.itemsize, participants)
    return Facts(op, dtype, nbytes, bus_factor(op, participants))


def nccl_bytes(op: str, count: int, itemsize: int, participants: int) -> int:
    """nccl-tests' "size": the whole buffer (the gathered output, the scattered input)."""
    if op in BLOCKED:
        return count * itemsize * participants
    return count * itemsize


def bus_factor(op: str, participants: int) -> float:
    return 1.0 if op == Collective.BARRIER else busbw_factor(COLLECTIVE_OF[op], participants)


def buffers(spec: Spec, arrival: Arrival, p: int) -> tuple[np.ndarray, np.ndarray] | tuple[Span, Span]:
    """The participant's (input, output) views; in place, both are views of its one buffer."""
    assert arrival.data is not None
    if arrival.out is None:
        op = COLLECTIVE_OF[spec.op]
        return layout(op, arrival.rank, p, spec.count, arrival.data, in_place=True, root=spec.root)
    # Both host or both device buffers (the control plane refuses a mix).
    return cast("tuple[np.ndarray, np.ndarray] | tuple[Span, Span]", (arrival.data, arrival.out))


def reduction(spec: Spec, dtype: np.dtype, participants: int) -> Reduction | None:
    """The reduction of a reducing collective (None for the others)."""
    if spec.op not in REDUCING:
        return None
    return _reduction(spec.reduce_op, dtype, participants)


@functools.lru_cache(maxsize=256)
def _reduction(op: str, dtype: np.dtype, participants: int) -> Reduction:
    return Reduction(REDUCE_OP_OF[op], dtype, participants)  # immutable: one per kind is shared
