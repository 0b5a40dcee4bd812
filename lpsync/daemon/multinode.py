"""Running one collective of a multi-node job: agree across nodes, then one pipeline.

When every local rank of a sequence number has arrived (matching.py), this daemon:
  1. takes the current peer mesh (peer_plane.py), waiting for it up to the deadline;
  2. agrees with every other node of the job (agreement.py: summaries of Spec and link
     model up a tree, node 0's verdict down): any difference fails the collective on
     every node alike with MismatchError (INVALID_ARGUMENT) naming the fields, nodes and
     ranks; a small collective's data rides the same messages and is done there
     (small.py);
  3. picks algorithm and chunks with the tuner from the slowest probed link of all nodes
     (shared_nic=True: one NIC per node), or takes the forced ``algorithm=``; the inputs
     are identical on every node, so every node builds the same schedule;
  4. runs its own participants' share with LocalGroup over a node-major Placement: local
     stage -> inter-node chain -> local stage is one chunk pipeline.
A peer lost mid-way breaks the mesh and every waiting participant fails at once with
UnavailableError. Invariant: message tags of collectives stay below 2**39 (bit 63 is the
peer plane's control space): tag = job hash (7 bits) | sequence (12 bits) | step (20 bits).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon import agreement
from lpsync.daemon.agreement import job_hash
from lpsync.daemon.device_staging import Staged, stage, whole
from lpsync.daemon.devices import DeviceRegistry
from lpsync.daemon.execute import BARRIER, GroupCache, _buffers, nccl_bytes
from lpsync.daemon.learning import Key, Learner, candidates
from lpsync.daemon.matching import RUNNING, Job, Outcome, Pending, Spec
from lpsync.daemon.peer_plane import Link, PeerPlane
from lpsync.daemon.small import SmallCollective, rides
from lpsync.engine.group import LocalGroup
from lpsync.engine.reduce import Reduction
from lpsync.engine.routing import Placement
from lpsync.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    UnavailableError,
)
from lpsync.types import Collective, ReduceOp, dtype_of

_NOTIFY_TIMEOUT = 5.0  # seconds a failed node waits at least for its part in the agreement
_STEP_BITS, _SEQ_BITS, _JOB_BITS = 20, 12, 7
_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)


def tag_base(job: str, sequence: int) -> int:
    return (
        (job_hash(job) & ((1 << _JOB_BITS) - 1)) << _SEQ_BITS | (sequence & ((1 << _SEQ_BITS) - 1))
    ) << _STEP_BITS


def run(job: Job, pending: Pending, plane: PeerPlane, devices: DeviceRegistry | None = None) -> Outcome:
    """The Runner for multi-node jobs (servicer.py picks it when job.layout is set).

    Device buffers cross nodes through host mirrors filled and drained chunk by chunk
    while the pipeline runs (device_staging.py).
    """
    assert job.layout is not None
    start = time.perf_counter()
    spec = pending.spec
    arrivals = [pending.arrivals[r] for r in job.local_ranks]
    timeout = min(a.timeout for a in arrivals)
    deadline = time.monotonic() + timeout
    link = plane.link(deadline)
    learner, key, trial = _learner(job), _key(spec, job.world_size), None
    last = learner.take_last()
    try:
        extras: list[tuple[str, Any]] = []
        if last is not None:
            extras.append(("last", last))  # a trial's time for node 0 (learning.py)
        if job.layout.node == 0 and _learns(spec, job.world_size):
            assert link.model is not None
            model = link.model
            choice, is_trial = learner.choose(
                key, lambda: candidates(Collective(spec.op), key[1], job.world_size, model)
            )
            extras += [("use", (choice.algorithm, choice.chunks)), ("trial", is_trial)]
            if is_trial:
                trial = choice.algorithm
                learner.issued(pending.sequence, key, choice)
        mine = agreement.summary(job, spec, link, tuple(extras))
        if rides(spec, job.world_size):
            staging = (
                whole(pending, arrivals, devices, deadline)
                if devices is not None
                else contextlib.nullcontext(arrivals)
            )
            with staging as hosts:
                small = SmallCollective(spec, job.world_size, hosts)
                verdict = agreement.agree(job, pending, link, deadline, mine, small)
                _learn(learner, verdict)
                pending.enter(RUNNING)
                assert verdict.result is not None
                small.write(verdict.result)
            shape = "exchange" if job.layout.nodes <= agreement.EXCHANGE_MAX_NODES else "tree"
            return Outcome(algorithm=shape, chunks=1, seconds=time.perf_counter() - start)
        verdict = agreement.agree(job, pending, link, deadline, mine)
        _learn(learner, verdict)
        pending.enter(RUNNING)
        if spec.op == BARRIER:
            return Outcome(algorithm="exchange", chunks=1, seconds=time.perf_counter() - start)
        if job.cache is None:
            job.cache = GroupCache()
        staged = stage(job, pending, devices, job.cache) if devices is not None else None
        began = time.perf_counter()
        algorithm, chunks = _run_pipeline(
            job, pending, link, verdict.model, deadline, staged, None if spec.algorithm else verdict.use
        )
        if verdict.trial:
            learner.ran(pending.sequence, time.perf_counter() - began)
    except LpsyncError as error:
        if trial is not None:
            learner.abandon(pending.sequence)
        if last is not None:
            learner.ran(*last)  # node 0 may not have it: it goes again with the next one
        if link.error is not None and not isinstance(error, MismatchError):
            if isinstance(link.error, CollectiveTimeoutError):
                raise type(link.error)(
                    f"collective #{pending.sequence} of job {job.name!r} timed out across nodes: {link.error}"
                ) from None
            raise UnavailableError(
                f"collective #{pending.sequence} of job {job.name!r} lost a peer node: {link.failure()}"
            ) from None
        raise
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=time.perf_counter() - start)


def notify_failure(job: Job, pending: Pending, error: LpsyncError, plane: PeerPlane) -> None:
    """This node failed ``pending`` before running it: take this node's part in the
    agreement with a summary that carries the error in place of the Spec, so that the
    other nodes fail it too instead of timing out (a timeout would break the mesh).
    Best effort: without a mesh there is nothing to tell."""
    if job.layout is None:
        return
    try:
        link = plane.link(time.monotonic())
    except LpsyncError:
        return
    # The other nodes wait for this node as long as their own timeouts allow.
    timeout = min((a.timeout for a in pending.arrivals.values()), default=_NOTIFY_TIMEOUT)
    deadline = time.monotonic() + max(_NOTIFY_TIMEOUT, timeout)
    # The verdict names this error (or an earlier node's), or the mesh broke: either way
    # this node's participants already have their error.
    with contextlib.suppress(LpsyncError):
        agreement.agree(job, pending, link, deadline, agreement.failure_summary(job, error))


def _learner(job: Job) -> Learner:
    assert job.layout is not None
    if job.learner is None:
        job.learner = Learner(job.layout.nodes)
    assert isinstance(job.learner, Learner)
    return job.learner


def _learn(learner: Learner, verdict: agreement.Verdict) -> None:
    """Node 0: the trial times the other nodes reported in their summaries."""
    for node, sequence, seconds in verdict.reports:
        learner.report(node, sequence, seconds)


def _key(spec: Spec, world_size: int) -> Key:
    if spec.op == BARRIER:
        return (spec.op, 0)
    return (spec.op, nccl_bytes(spec.op, spec.count, dtype_of(spec.dtype).itemsize, world_size))


def _learns(spec: Spec, world_size: int) -> bool:
    """Node 0 picks (and times) the schedule: a pipelined collective, algorithm not forced."""
    return spec.op != BARRIER and not spec.algorithm and not rides(spec, world_size)


def _run_pipeline(
    job: Job,
    pending: Pending,
    link: Link,
    model: LinkModel,
    deadline: float,
    staged: Staged | None = None,
    use: tuple[str, int] | None = None,
) -> tuple[str, int]:
    """Run this node's share; ``use``: node 0's (algorithm, chunks), else the tuner's."""
    assert job.layout is not None
    spec, layout, p = pending.spec, job.layout, job.world_size
    op, dtype = Collective(spec.op), dtype_of(spec.dtype)
    arrivals = staged.arrivals if staged is not None else [pending.arrivals[r] for r in job.local_ranks]
    buffers = [_buffers(op, a, p, spec.count) for a in arrivals]
    reduction = Reduction(ReduceOp(spec.reduce_op), dtype, p) if op in _REDUCING else None
    nbytes = nccl_bytes(op, spec.count, dtype.itemsize, p)
    if spec.algorithm:
        algorithm, chunks = spec.algorithm, chunks_for(spec.algorithm, p, nbytes, model, op=op)
    elif use is not None:
        algorithm, chunks = use
    else:
        choice = select(op, nbytes, p, model)
        algorithm, chunks = choice.algorithm, choice.chunks
    if job.cache is None:
        job.cache = GroupCache()
    # The mesh generation is part of the key: a rebuilt mesh is another remote endpoint.
    key = (
        spec,
        algorithm,
        chunks,
        link.generation,
        tuple(arr.__array_interface__["data"][0] for pair in buffers for arr in pair),
        staged.mirrors.serial if staged is not None else 0,  # plans bound to these mirrors
        tuple(h for a in arrivals for h in a.handles),
    )

    def build() -> LocalGroup:
        schedule = generate(op, algorithm, p, spec.count, spec.root, chunks)
        if schedule.tags.size and int(schedule.tags.max()) >= 1 << _STEP_BITS:
            raise InvalidArgumentError(
                f"{algorithm} {op} of {spec.count} elements needs more than 2**{_STEP_BITS} messages per pair"
            )
        placement = Placement.node_major([layout.ranks_per_node] * layout.nodes, layout.node)
        group = LocalGroup(schedule, buffers, reduction, placement, link.endpoint)
        if staged is not None:
            staged.attach(group)
        return group

    group = job.cache.get(key, build)
    timeout, tags = max(0.0, deadline - time.monotonic()), tag_base(job.name, pending.sequence)
    if staged is None:
        group.run(timeout, tags)
    else:
        staged.run(group, deadline, timeout, tags)
    return algorithm, chunks
