"""The value types of a collective's path through the daemon, shared by every role.

A collective is matched (Spec, Arrival, Pending: matching.py), agreed across nodes,
planned, staged and run (collectives/), and recorded (FlightRecord, Waiting: the flight
recorder of ``lpsync status``). These types carry no behaviour beyond their own fields.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import numpy as np

from lpsync.daemon.watcher import Timer
from lpsync.errors import LpsyncError

if TYPE_CHECKING:
    from lpsync.memory.kind import Span

T = TypeVar("T")

INTACT, PARTIAL, UNSPECIFIED = "INTACT", "PARTIAL", ""


@dataclass(frozen=True)
class NodeLayout:
    """A multi-node job: the node of every rank and which node this daemon is, in the
    job's own node numbers 0..nodes-1; ``cluster`` maps them to daemons of --peers (empty:
    the same numbers, the job on daemons 0..nodes-1). Any map: ranks need not be
    node-major and nodes may serve different numbers of ranks (the ranks discover it,
    control/layout.py); a job on daemons 2 and 5 is the job's nodes 0 and 1."""

    node_of: tuple[int, ...]  # by rank: the job's node serving it
    node: int  # this daemon's node in the job's numbers
    cluster: tuple[int, ...] = ()  # job node -> daemon of --peers; () where they are equal
    # Derived once (a job asks for them on every collective); not part of equality.
    nodes: int = field(init=False, compare=False)  # nodes 0..nodes-1 serve the job
    local_ranks: tuple[int, ...] = field(init=False, compare=False)  # this node's, ascending
    local_text: str = field(init=False, compare=False)  # them as messages name them: ranks_text
    by_node: tuple[int, ...] = field(init=False, compare=False)  # node 0's ranks, node 1's...
    node_major: bool = field(init=False, compare=False)  # by_node is rank order
    daemons: tuple[int, ...] = field(init=False, compare=False)  # daemon(n) of every node n

    def __post_init__(self) -> None:
        by_node = tuple(sorted(range(len(self.node_of)), key=lambda r: (self.node_of[r], r)))
        object.__setattr__(self, "nodes", max(self.node_of) + 1)
        object.__setattr__(self, "local_ranks", self.ranks_of(self.node))
        object.__setattr__(self, "local_text", ranks_text(self.local_ranks))
        object.__setattr__(self, "by_node", by_node)
        object.__setattr__(self, "node_major", by_node == tuple(range(len(by_node))))
        nodes = range(max(self.node_of) + 1)
        daemons = tuple(self.cluster[n] for n in nodes) if self.cluster else tuple(nodes)
        object.__setattr__(self, "daemons", daemons)

    @classmethod
    def uniform(cls, ranks_per_node: int, nodes: int, node: int) -> NodeLayout:
        """torchrun's numbering: node n serves ranks n*L .. n*L+L-1."""
        return cls(tuple(r // ranks_per_node for r in range(ranks_per_node * nodes)), node)

    def ranks_of(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def daemon(self, node: int) -> int:
        """The daemon (node rank in --peers) serving the job's node ``node``."""
        return self.cluster[node] if self.cluster else node

    def describe(self) -> str:
        """'node 0: ranks 0-2; node 1: rank 3' (daemons' node ranks), for error messages."""
        return "; ".join(f"node {self.daemon(n)}: {ranks_text(self.ranks_of(n))}" for n in range(self.nodes))


def ranks_text(ranks: Sequence[int]) -> str:
    """'ranks 0-2, 5' / 'rank 3' / 'no ranks': runs of consecutive ranks folded."""
    if not ranks:
        return "no ranks"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


class Spec(NamedTuple):
    """What every participant of one collective must agree on. A tuple: it keys caches
    on every collective's path (views.facts, the agreement's summaries), and a tuple's
    hash is computed in C where a frozen dataclass's runs in Python."""

    op: str
    dtype: str
    count: int  # type: ignore[assignment]  # shadows tuple.count, which no Spec uses
    root: int
    reduce_op: str
    algorithm: str
    name: str

    def differences(self, other: Spec) -> list[str]:
        return [f for f in SPEC_FIELDS if getattr(self, f) != getattr(other, f)]


# The fields participants must agree on, in the order errors name them.
SPEC_FIELDS = ("op", "count", "dtype", "root", "reduce_op", "algorithm", "name")


@dataclass(slots=True)
class Outcome:
    error: LpsyncError | None = None
    buffer_state: str = UNSPECIFIED
    algorithm: str = ""
    chunks: int = 0
    seconds: float = 0.0
    # The plan is armed (lpsync/native): (doorbell page, plan, generation) for the reply.
    armed: tuple[str, int, int] | None = None
    done_event: bytes = b""  # stream-ordered device collective: the daemon's done event handle


class Later(Generic[T]):
    """A value another thread brings: a peer connection's reader (the message a
    collective waited for), or the heartbeat watchdog at a deadline. Set once, by
    whichever comes first; ``then`` runs on the thread that sets it, or at once where it
    is set already. A collective that ends this way costs no thread a wake-up to learn
    of it (path.py)."""

    __slots__ = ("_lock", "_set", "_then", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._value: T | None = None
        self._then: Callable[[T], None] | None = None

    def set(self, value: T) -> bool:
        """Set it (True), or nothing where it was set already (False)."""
        with self._lock:
            if self._set:
                return False
            self._set, self._value, then = True, value, self._then
        if then is not None:
            then(value)
        return True

    def then(self, callback: Callable[[T], None]) -> None:
        """Call ``callback`` with the value once it is set (one callback)."""
        with self._lock:
            if not self._set:
                self._then = callback
                return
            value = self._value
        callback(value)  # type: ignore[arg-type]  # set: a T


@dataclass(slots=True)
class Arrival:
    rank: int
    sequence: int
    spec: Spec
    timeout: float
    # Host buffers are numpy arrays, device buffers Spans (every participant alike).
    data: np.ndarray | Span | None  # the input (in place: the one buffer); None for barrier
    out: np.ndarray | Span | None  # None: in place
    handles: tuple[tuple[str, int], ...]  # (session id, handle) of the buffers, for caches
    done: Callable[[Outcome], None]
    at: float = 0.0  # time.monotonic() of the arrival (set by Job.submit)
    ready: Any = None  # device buffers: the client's opened event the streams wait on first
    stream_ordered: bool = False  # device buffers: answer once enqueued, with a done event

    @property
    def in_place(self) -> bool:
        return self.out is None and self.data is not None


# Stages of a collective as the flight recorder names them.
ARRIVING, QUEUED, AGREEING, RUNNING = "arriving", "queued", "agreeing", "running"


@dataclass(slots=True)
class Pending:
    sequence: int
    spec: Spec
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    timer: Timer | None = None
    stall_checked: bool = False  # the job's stall watch looked at it (matching.py)
    opened: float = field(default_factory=time.monotonic)  # the first arrival
    opened_wall: float = field(default_factory=time.time)
    # Where it is now, and since when (monotonic); written by its one running thread.
    stage: str = ARRIVING
    stage_since: float = 0.0
    stages: list[tuple[str, float]] = field(default_factory=list)  # finished: (name, seconds)
    waiting_nodes: tuple[int, ...] = ()  # multi-node agreement: nodes not heard from yet
    stalled: bool = False

    def enter(self, stage: str, now: float | None = None) -> None:
        """Close the current stage and open ``stage`` (the runner calls this)."""
        now = time.monotonic() if now is None else now
        self.stages.append((self.stage, now - (self.stage_since or self.opened)))
        self.stage, self.stage_since = stage, now


class FlightRecord(NamedTuple):
    """One finished collective as ``lpsync status`` shows it (a tuple: one is made per
    collective, and a tuple costs a fraction of a frozen dataclass to make)."""

    sequence: int
    spec: Spec
    started_at: float  # unix time of the first arrival
    arrivals: tuple[tuple[int, float], ...]  # (rank, seconds after the first arrival)
    stages: tuple[tuple[str, float], ...]  # (stage, seconds), in order
    seconds: float  # first arrival to outcome
    algorithm: str
    chunks: int
    code: str
    message: str


@dataclass(frozen=True)
class Waiting:
    """A collective of a job that has not finished yet."""

    sequence: int
    op: str
    stage: str
    started_at: float  # unix time of the first arrival
    seconds: float  # since the first arrival
    arrived: tuple[int, ...]
    missing_ranks: tuple[int, ...]  # local ranks not arrived, or the ranks of missing nodes
    missing_nodes: tuple[int, ...]
    stalled: bool
