"""The value types of a collective's path through the daemon, shared by every role.

A collective is matched (Spec, Arrival, Pending: matching.py), agreed across nodes,
planned, staged and run (collectives/), and recorded (FlightRecord, Waiting: the flight
recorder of ``lpsync status``). These types carry no behaviour beyond their own fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lpsync.daemon.watcher import Timer
from lpsync.errors import LpsyncError

INTACT, PARTIAL, UNSPECIFIED = "INTACT", "PARTIAL", ""


@dataclass(frozen=True)
class NodeLayout:
    """A multi-node job, node-major: node n serves ranks n*L .. n*L+L-1 (torchrun's
    RANK = node_rank * LOCAL_WORLD_SIZE + LOCAL_RANK); node n is daemon n of --peers."""

    ranks_per_node: int  # L, LOCAL_WORLD_SIZE (uniform across nodes)
    nodes: int  # WORLD_SIZE // L
    node: int  # this daemon's node rank

    @property
    def local_ranks(self) -> range:
        return range(self.node * self.ranks_per_node, (self.node + 1) * self.ranks_per_node)


@dataclass(frozen=True)
class Spec:
    """What every participant of one collective must agree on."""

    op: str
    dtype: str
    count: int
    root: int
    reduce_op: str
    algorithm: str
    name: str

    def differences(self, other: Spec) -> list[str]:
        return [f for f in SPEC_FIELDS if getattr(self, f) != getattr(other, f)]


# The fields participants must agree on, in the order errors name them.
SPEC_FIELDS = ("op", "count", "dtype", "root", "reduce_op", "algorithm", "name")


@dataclass
class Outcome:
    error: LpsyncError | None = None
    buffer_state: str = UNSPECIFIED
    algorithm: str = ""
    chunks: int = 0
    seconds: float = 0.0


@dataclass
class Arrival:
    rank: int
    sequence: int
    spec: Spec
    timeout: float
    data: np.ndarray | None  # the input (in place: the one buffer); None for barrier
    out: np.ndarray | None  # None: in place
    handles: tuple[tuple[str, int], ...]  # (session id, handle) of the buffers, for caches
    done: Callable[[Outcome], None]
    at: float = 0.0  # time.monotonic() of the arrival (set by Job.submit)
    ready: Any = None  # device buffers: the client's opened event the streams wait on first

    @property
    def in_place(self) -> bool:
        return self.out is None and self.data is not None


# Stages of a collective as the flight recorder names them.
ARRIVING, QUEUED, AGREEING, RUNNING = "arriving", "queued", "agreeing", "running"


@dataclass
class Pending:
    sequence: int
    spec: Spec
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    timer: Timer | None = None
    stall_timer: Timer | None = None
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


@dataclass(frozen=True)
class FlightRecord:
    """One finished collective as ``lpsync status`` shows it."""

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
