"""The tuner: the best algorithm and chunking for (op, bytes, participants, link model)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lpsync.algorithms.cost import DEFAULT_MIN_CHUNK_BYTES, LinkModel, closed_form, lp_chunks
from lpsync.algorithms.registry import ALGORITHMS, algorithms_for
from lpsync.errors import InvalidArgumentError
from lpsync.types import Collective


@dataclass(frozen=True)
class Choice:
    algorithm: str
    chunks: int
    seconds: float  # the model's prediction


def chunks_for(algorithm: str, participants: int, nbytes: int, link: LinkModel,
               min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES, op: Collective | None = None) -> int:
    if not ALGORITHMS[algorithm].pipelined:
        return 1
    return lp_chunks(participants, nbytes, link, min_chunk_bytes, op)


def select(op: Collective, nbytes: int, participants: int, link: LinkModel,
           candidates: Iterable[str] | None = None,
           min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> Choice:
    """The candidate (default: every algorithm offering ``op``) the model predicts fastest.

    Ties go to the earlier candidate in registry order, so the choice is deterministic:
    every participant that asks the same question gets the same answer.
    """
    names = list(candidates) if candidates is not None else algorithms_for(op)
    offered = [n for n in names if n in ALGORITHMS and op in ALGORITHMS[n].generators]
    if not offered:
        raise InvalidArgumentError(f"none of {names} offers {op}")
    best: Choice | None = None
    for name in offered:
        k = chunks_for(name, participants, nbytes, link, min_chunk_bytes, op)
        seconds = closed_form(op, name, participants, nbytes, link, k)
        if best is None or seconds < best.seconds:
            best = Choice(name, k, seconds)
    assert best is not None
    return best
