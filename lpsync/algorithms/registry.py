"""The registry of algorithms with their metadata; the tuner and the CLI both read it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lpsync.algorithms import be, linear, lp, mst, ring
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder
from lpsync.errors import InvalidArgumentError
from lpsync.types import Collective

# (participants >= 2, count, root, chunks) -> Schedule; generate() handles one participant.
Generator = Callable[[int, int, int, int], Schedule]


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str  # one line, shown by the CLI
    suits: str  # which sizes and link models it is good for
    pipelined: bool  # whether it takes a chunk count
    generators: Mapping[Collective, Generator]


# Not a schedule: the last participant to arrive reduces every view in rank order and
# writes every output (lpsync.daemon.collectives.local). Local host buffers only.
DIRECT = "direct"

C = Collective
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "lp",
            "linear pipeline: a chain, the message cut into k chunks",
            "large messages; cost flat in P",
            True,
            {C.BROADCAST: lp.broadcast_lp, C.REDUCE: lp.reduce_lp, C.ALLREDUCE: lp.allreduce_lp},
        ),
        Algorithm(
            "ring",
            "ring reduce-scatter and allgather (NCCL, Gloo, Horovod); allreduce's blocks cut into k slices",
            "large allreduce with one NIC per node",
            True,
            {
                C.ALLREDUCE: ring.allreduce_ring,
                C.REDUCE_SCATTER: ring.reduce_scatter_ring,
                C.ALLGATHER: ring.allgather_ring,
            },
        ),
        Algorithm(
            "mst",
            "binomial tree (minimum spanning tree), whole message per round",
            "small messages: ceil(log2 P) latencies",
            False,
            {C.BROADCAST: mst.broadcast_mst, C.REDUCE: mst.reduce_mst, C.ALLREDUCE: mst.allreduce_mst},
        ),
        Algorithm(
            "be",
            "bidirectional exchange: scatter/reduce-scatter + allgather/gather",
            "medium messages: 2 log2 P latencies, 2(P-1)/P bytes",
            False,
            {
                C.BROADCAST: be.broadcast_be,
                C.REDUCE: be.reduce_be,
                C.ALLREDUCE: be.allreduce_be,
                C.ALLGATHER: be.allgather_be,
                C.REDUCE_SCATTER: be.reduce_scatter_be,
            },
        ),
        Algorithm(
            "linear",
            "every block straight between its owner and the root",
            "gather and scatter: (P-1) blocks on the root's link, one hop each",
            False,
            {C.GATHER: linear.gather_linear, C.SCATTER: linear.scatter_linear},
        ),
        Algorithm(
            "pairwise",
            "pairwise exchange: in step s, v sends to v+s and receives from v-s",
            "all-to-all: every link busy both ways, (P-1) steps",
            False,
            {C.ALLTOALL: linear.alltoall_pairwise},
        ),
    )
}


def algorithms_for(op: Collective) -> list[str]:
    return [name for name, algo in ALGORITHMS.items() if op in algo.generators]


def generate(
    op: Collective, algorithm: str, participants: int, count: int, root: int = 0, chunks: int = 1
) -> Schedule:
    """The schedule of ``op`` by ``algorithm``; InvalidArgumentError for impossible requests."""
    if algorithm not in ALGORITHMS:
        raise InvalidArgumentError(
            f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}"
        )
    algo = ALGORITHMS[algorithm]
    if op not in algo.generators:
        raise InvalidArgumentError(
            f"algorithm {algorithm!r} has no {op}; {op} is offered by {', '.join(algorithms_for(op))}"
        )
    if participants < 1:
        raise InvalidArgumentError(f"participants must be >= 1, got {participants}")
    if count < 0:
        raise InvalidArgumentError(f"count must be >= 0, got {count}")
    if not 0 <= root < participants:
        raise InvalidArgumentError(f"root {root} is not a participant (0..{participants - 1})")
    if chunks < 1:
        raise InvalidArgumentError(f"chunks must be >= 1, got {chunks}")
    if algo.pipelined:
        chunks = max(1, min(chunks, count))
    if participants == 1:  # every collective of one participant is a copy of IN to OUT
        b = ScheduleBuilder(op, algorithm, 1, count, root, chunks if algo.pipelined else 1)
        b.copy(0, 0, Buf.OUT, 0, count, Buf.IN, 0)
        return b.build()
    return algo.generators[op](participants, count, root, chunks if algo.pipelined else 1)
