"""The tuner: the best algorithm and chunking for (op, bytes, participants, link model)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from lpsync.algorithms.cost import (
    DEFAULT_MIN_CHUNK_BYTES,
    LinkModel,
    closed_form,
    lp_chunks,
    ring_slices,
)
from lpsync.algorithms.registry import ALGORITHMS, algorithms_for
from lpsync.errors import InvalidArgumentError
from lpsync.types import Collective

# The learning tuner (lpsync/daemon/collectives/learning.py) times at most MAX_CANDIDATES
# candidates TRIALS times each on a job's first calls of a size; here, beside the model
# it refines, so that a benchmark can skip those calls without reaching into the daemon.
TRIALS = 2  # timed runs per shortlisted candidate
MAX_CANDIDATES = 6  # trials per size stay bounded: TRIALS * MAX_CANDIDATES calls at most
LEARNING_CALLS = MAX_CANDIDATES * TRIALS + 1  # the trials, and the call that reports the last


@dataclass(frozen=True)
class Choice:
    algorithm: str
    chunks: int
    seconds: float  # the model's prediction


def chunks_for(
    algorithm: str,
    participants: int,
    nbytes: int,
    link: LinkModel,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
    op: Collective | None = None,
) -> int:
    if not ALGORITHMS[algorithm].pipelined:
        return 1
    if algorithm == "ring":
        return ring_slices(participants, nbytes, link)
    return lp_chunks(participants, nbytes, link, min_chunk_bytes, op)


TIE_MARGIN = 0.05


def select(
    op: Collective,
    nbytes: int,
    participants: int,
    link: LinkModel,
    candidates: Iterable[str] | None = None,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
) -> Choice:
    """The candidate (default: every algorithm offering ``op``) the model predicts fastest.

    Predictions within TIE_MARGIN of the fastest count as ties, and ties go to the earlier
    candidate in registry order (lp, ring, mst, be), so the choice is deterministic —
    every participant that asks the same question gets the same answer — and a model
    difference smaller than the model's own error does not decide. (Measured on the
    emulated cluster: for a 64 MiB allreduce on 8 nodes the model put BE 1% ahead of
    ring on latency terms alone; BE ran 1.23-1.35x slower than ring.)

    Answers are remembered: the daemon asks once per collective (a device one, a host
    one past the direct path's size, a multi-node one not learned) and the answer
    depends on the arguments alone, where working it out costs every candidate's closed
    form (~40 us of Python on this machine; docs/benchmarks.md at 623decd, 2026-12-06).
    """
    names = None if candidates is None else tuple(candidates)
    return _select(op, nbytes, participants, link, names, min_chunk_bytes)


@functools.lru_cache(maxsize=4096)
def _select(
    op: Collective,
    nbytes: int,
    participants: int,
    link: LinkModel,
    candidates: tuple[str, ...] | None,
    min_chunk_bytes: int,
) -> Choice:
    predicted = predictions(op, nbytes, participants, link, candidates, min_chunk_bytes)
    fastest = min(choice.seconds for choice in predicted)
    return next(c for c in predicted if c.seconds <= fastest * (1 + TIE_MARGIN))


def predictions(
    op: Collective,
    nbytes: int,
    participants: int,
    link: LinkModel,
    candidates: Iterable[str] | None = None,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
) -> list[Choice]:
    """Every candidate that offers ``op`` with its chunk count and predicted time, in
    registry order (lp, ring, mst, be)."""
    names = list(candidates) if candidates is not None else algorithms_for(op)
    offered = [n for n in names if n in ALGORITHMS and op in ALGORITHMS[n].generators]
    if not offered:
        raise InvalidArgumentError(f"none of {names} offers {op}")
    order = list(ALGORITHMS)
    predicted = []
    for name in sorted(offered, key=order.index):
        k = chunks_for(name, participants, nbytes, link, min_chunk_bytes, op)
        predicted.append(Choice(name, k, closed_form(op, name, participants, nbytes, link, k)))
    return predicted
