"""The "planned" stage of a multi-node collective: which schedule, and its built plan.

Before the agreement node 0 proposes (``propose``): a pipelined collective whose algorithm
is not forced runs the learning tuner's choice (learning.py), carried to every node in
the verdict. After it, every node resolves the same (algorithm, chunks) (``choose``):
the forced algorithm, node 0's word, or the tuner's pick for the slowest link of all.
``bind`` then takes the job's plan for that schedule over this run's buffers, built once
per (spec, schedule, buffers, mesh generation) and reused (plans.py).
A collective's message tags are ``tag_base`` plus its steps (lpsync.transport.tags, where
every tag layout lives; ``path.py`` reads ``planning.tag_base``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.collectives.hierarchy import HIERARCHICAL
from lpsync.daemon.collectives.learning import Key, Learner, candidates
from lpsync.daemon.collectives.plans import plan_key
from lpsync.daemon.collectives.staging import Staged
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.daemon.peers.plane import Link
from lpsync.engine.buffers import HOST
from lpsync.engine.group import LocalGroup
from lpsync.engine.routing import Placement
from lpsync.errors import InvalidArgumentError
from lpsync.transport.tags import STEP_BITS
from lpsync.transport.tags import tag_base as tag_base
from lpsync.types import Collective

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Proposal:
    """What this node says of the schedule in its agreement summary."""

    extras: tuple[tuple[str, Any], ...]  # the summary's learning fields ("use", "trial", "last")
    trial: bool  # node 0 times this run
    last: tuple[int, float] | None  # this node's latest trial (sequence, seconds), reported


def learns(task: Task, rides: bool) -> bool:
    """Node 0 picks (and times) the schedule: a pipelined collective, algorithm not forced,
    not one whose data rides the agreement (``rides``, small.rides), and not one that
    device buffers run in hierarchy.py's segments (picked per segment)."""
    return (
        task.op is not Collective.BARRIER
        and not task.spec.algorithm
        and not rides
        and not (task.on_device and task.op in HIERARCHICAL)
    )


def propose(task: Task, learner: Learner, link: Link, rides: bool) -> Proposal:
    """This node's learning fields (learning.py, the job's ``learner``): its latest
    trial's time for node 0, and on node 0 what every node runs."""
    assert task.job.layout is not None
    chooses = task.job.layout.node == 0 and learns(task, rides)
    key = _key(task)
    last = learner.take_last()
    extras: list[tuple[str, Any]] = []
    if last is not None:
        extras.append(("last", last))  # a trial's time for node 0 (learning.py)
    trial = False
    if chooses:
        model = link.model
        assert model is not None
        choice, trial = learner.choose(
            key, lambda: candidates(task.op, key[1], task.participants, model), task.pending.sequence
        )
        extras += [("use", (choice.algorithm, choice.chunks)), ("trial", trial)]
    return Proposal(tuple(extras), trial, last)


def _key(task: Task) -> Key:
    return (task.spec.op, 0 if task.op is Collective.BARRIER else task.nbytes)


def choose(task: Task, model: LinkModel, use: tuple[str, int] | None) -> tuple[str, int]:
    """(algorithm, chunks): the forced algorithm, node 0's ``use``, else the tuner's pick."""
    spec, p = task.spec, task.participants
    if spec.algorithm:
        return spec.algorithm, chunks_for(spec.algorithm, p, task.nbytes, model, op=task.op)
    if use is not None:
        return use
    choice = select(task.op, task.nbytes, p, model)
    return choice.algorithm, choice.chunks


def bind(task: Task, link: Link, algorithm: str, chunks: int, staged: Staged | None) -> LocalGroup:
    """This node's plan of the schedule over this run's buffers (host arrays, or device
    spans through their BouncedBuffers)."""
    layout = task.job.layout
    assert layout is not None
    spec, op, p = task.spec, task.op, task.participants
    arrivals = staged.arrivals if staged is not None else task.arrivals
    views = cast("list[tuple[np.ndarray, np.ndarray]]", [buffers(spec, a, p) for a in arrivals])
    # The mesh generation is part of the key: a rebuilt mesh is another remote endpoint;
    # so are the device buffers a staged run is bound to.
    bounced = staged.serial if staged is not None else 0
    key = plan_key(spec, (algorithm, chunks), arrivals, link.generation, bounced)

    def build() -> LocalGroup:
        schedule = generate(op, algorithm, p, spec.count, spec.root, chunks)
        if schedule.tags.size and int(schedule.tags.max()) >= 1 << STEP_BITS:
            raise InvalidArgumentError(
                f"{algorithm} {op} of {spec.count} elements needs more than 2**{STEP_BITS} messages per pair"
            )
        placement = Placement.of(layout.node_of, layout.node)
        memory = staged.memory if staged is not None else HOST  # device spans: their own each
        return LocalGroup(schedule, views, reduction(spec, task.dtype, p), placement, link.endpoint, memory)

    return task.job.plans.get(key, build)
