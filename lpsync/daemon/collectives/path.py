"""A collective's path through the daemon: one Task moving forward through its stages.

    matched (matching.py: every local participant arrived, specs agree; Task.matched)
      single node:  run (runners.py: native, direct, host pipeline or device chain) -> finished
      multi-node:   agreed   (agreement.py: summaries up a tree, node 0's verdict down;
                              a small collective's data rides it and is done there, as
                              a barrier is; on a leaf, where the verdict lands)
                    planned  (planning.py: the forced algorithm, node 0's learned choice
                              or the tuner's pick for the slowest link of all)
                    run      (runners.py's table, by the verdict: the plan bound to this
                              run's buffers, staged where they are on devices: local
                              stage -> inter-node chain -> local stage, one chunk pipeline;
                              hierarchy.py or packed.py where every node's buffers are on
                              devices: the device chain, a bounded host ring, the peers)
                    finished (an Outcome, or the error every node reports alike)
Each stage takes what the earlier ones produced and hands its own result on; none calls
back into another. A peer lost mid-way breaks the mesh and every waiting participant
fails at once with UnavailableError. So does every node when one of them fails with an
internal error (a bug, not an LpsyncError): the others wait on its part, and would wait
out their timeout, which breaks the mesh anyway; it breaks the mesh at once instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import NoReturn

from lpsync.daemon.collectives import agreement, hierarchy, native_across, planning, runners
from lpsync.daemon.collectives.learning import Learner
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.small import SmallCollective, rides
from lpsync.daemon.collectives.staging import whole
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.plane import Link, PeerPlane
from lpsync.daemon.values import RUNNING, Later, Outcome, Pending
from lpsync.errors import CollectiveTimeoutError, LpsyncError, MismatchError, UnavailableError
from lpsync.types import Collective

log = logging.getLogger("lpsync.daemon")

# Nodes that the loss did not cut off may have finished it (the verdict or the data had
# reached them): a report, not a second agreement round (outcomes.py says why).
_MAY_HAVE_FINISHED = (
    "; other nodes may have finished it: `lpsync status` on any node names each node's "
    "outcome once the mesh is back"
)
_NOTIFY_TIMEOUT = 5.0  # seconds a failed node waits at least for its part in the agreement


def run(
    job: Job, pending: Pending, plane: PeerPlane | None, devices: DeviceRegistry | None
) -> Outcome | Later[Outcome]:
    """Run ``pending`` from matched to finished (the Runner of matching.py); a small
    collective on a leaf of the agreement tree finishes on the reader of its verdict."""
    task = Task.matched(job, pending)
    if job.layout is None or plane is None:
        return runners.run(task, runners.Context(devices))
    return _across_nodes(task, plane, devices)


def _across_nodes(task: Task, plane: PeerPlane, devices: DeviceRegistry | None) -> Outcome | Later[Outcome]:
    job, pending = task.job, task.pending
    assert job.layout is not None
    deadline = time.monotonic() + task.timeout
    try:
        link = plane.link(deadline).for_job(job.layout.cluster)
    except UnavailableError as error:
        # No mesh (lost, or rebuilt while this waited): nodes whose new mesh is up by the
        # time their ranks arrive would wait out their timeout for this node's part.
        failure, cluster, sequence = (
            agreement.failure_summary(job, error),
            job.layout.cluster,
            pending.sequence,
        )
        plane.owe(
            deadline,
            lambda link: agreement.announce(job, sequence, link.for_job(cluster), failure),
        )
        raise
    armed_failure = native_across.failure(task)
    if armed_failure is not None:  # its armed run failed here: it fails, on every node
        _armed_run_failed(task, link, armed_failure)
    native_across.notice(task)  # armed peers fall back at once: this node runs it here
    if job.learner is None:
        job.learner = Learner(job.layout.nodes)
    learner = job.learner  # what node 0 learned (learning.py)
    last = learner.take_last()  # an earlier trial's time, for node 0
    proposal = None
    try:
        proposal = planning.propose(task, learner, link, last)
        offers = proposal.extras + hierarchy.offer(task, devices) + native_across.offer(task, plane)
        mine = agreement.summary(job, task.spec, link, offers)
        barrier = task.op is Collective.BARRIER
        if barrier or rides(task):  # finished once agreed: a barrier, or data riding it
            with _riding(task, devices, deadline) as small:
                # On this thread where it may be armed (arming may connect sockets) or is
                # staged from devices (the staging ends with this block).
                armable = any(name == "native" for name, _ in offers)
                later = (
                    None
                    if armable or task.on_device
                    else agreement.agree_later(job, pending, link, deadline, mine, small)
                )
                if later is None:
                    verdict = agreement.agree(job, pending, link, deadline, mine, small)
                    outcome = _finish_agreed(task, learner, small, verdict)
                    if small is not None and not task.on_device:
                        outcome.armed = native_across.after_ride(task, plane, verdict)
                    return outcome
            return _finished_later(task, link, learner, last, proposal, small, later)
        verdict = agreement.agree(job, pending, link, deadline, mine)
        _learn(learner, verdict)
        pending.enter(RUNNING)
        tags = planning.tag_base(job.name, pending.sequence)
        context = runners.Context(devices, link, verdict, learner, deadline, tags, plane)
        return runners.run(task, context)
    except Exception as error:
        native_across.drop(task)  # a failed call: the job's channels start afresh
        reported = _failed(task, link, learner, last, proposal, error)
        if reported is error:
            raise
        raise reported from (error if not isinstance(error, LpsyncError) else None)


def _armed_run_failed(task: Task, link: Link, error: LpsyncError) -> NoReturn:
    """This node's armed run of the call failed (native_across.failure): the job's
    channels go, the nodes that run the call on the general path learn it through the
    agreement (bounded: a node whose armed run went on never comes), and it fails here."""
    job, pending = task.job, task.pending
    native_across.drop(task)
    deadline = time.monotonic() + _NOTIFY_TIMEOUT
    with contextlib.suppress(LpsyncError):
        agreement.agree(job, pending, link, deadline, agreement.failure_summary(job, error))
    raise error


@contextlib.contextmanager
def _riding(task: Task, devices: DeviceRegistry | None, deadline: float) -> Iterator[SmallCollective | None]:
    """The collective that rides the agreement (None: a barrier, nothing rides): on host
    buffers as they are, on devices staged through host mirrors while it runs."""
    if task.op is Collective.BARRIER:
        yield None
    elif task.on_device:
        with whole(task, devices, deadline) as hosts:
            yield SmallCollective(task, hosts)
    else:
        yield SmallCollective(task, task.arrivals)


def _finish_agreed(
    task: Task, learner: Learner, small: SmallCollective | None, verdict: agreement.Verdict
) -> Outcome:
    """The verdict of a collective the agreement finishes came (with the result of one
    riding it, ``small``; None: a barrier): learn from it, write the result."""
    _learn(learner, verdict)
    task.pending.enter(RUNNING)
    if small is None:
        return Outcome(algorithm="exchange", chunks=1, seconds=task.elapsed())
    assert verdict.result is not None and task.job.layout is not None
    small.write(verdict.result)
    shape = "exchange" if task.job.layout.nodes <= agreement.EXCHANGE_MAX_NODES else "tree"
    return Outcome(algorithm=shape, chunks=1, seconds=task.elapsed())


def _finished_later(
    task: Task,
    link: Link,
    learner: Learner,
    last: tuple[int, float] | None,
    proposal: planning.Proposal,
    small: SmallCollective | None,
    agreed: Later[agreement.Verdict | Exception],
) -> Later[Outcome]:
    """The rest of a collective the agreement finishes (a barrier, or ``small`` riding
    it), run where its verdict lands (agreement.agree_later)."""
    finished: Later[Outcome] = Later()

    def then(verdict: agreement.Verdict | Exception) -> None:
        try:
            if isinstance(verdict, Exception):
                raise verdict
            outcome = _finish_agreed(task, learner, small, verdict)
        except Exception as error:  # on a reader thread: every error becomes the outcome
            outcome = Outcome(_failed(task, link, learner, last, proposal, error))
        finished.set(outcome)

    agreed.then(then)
    return finished


def _failed(
    task: Task,
    link: Link,
    learner: Learner,
    last: tuple[int, float] | None,
    proposal: planning.Proposal | None,
    error: Exception,
) -> LpsyncError:
    """The error a collective that failed across nodes with ``error`` reports: an internal
    error breaks the mesh; a broken mesh says what broke it (a lost peer, a timeout);
    anything else is ``error`` itself. Undoes this call's part in node 0's learning."""
    job, pending = task.job, task.pending
    if proposal is not None and proposal.trial:
        learner.abandon(pending.sequence)
    if last is not None:
        learner.ran(*last)  # node 0 may not have it: it goes again with the next one
    if not isinstance(error, LpsyncError):
        return _internal(task, link, error)
    if link.error is not None and not isinstance(error, MismatchError):
        if isinstance(link.error, CollectiveTimeoutError):
            return type(link.error)(
                f"collective #{pending.sequence} of job {job.name!r} timed out across nodes: {link.error}"
            )
        return UnavailableError(
            f"collective #{pending.sequence} of job {job.name!r} lost a peer node: {link.failure()}"
            f"{_MAY_HAVE_FINISHED}"
        )
    return error


def _internal(task: Task, link: Link, error: Exception) -> LpsyncError:
    """This node failed ``task`` with an internal error: log it whole, break the mesh so
    that the other nodes fail now (UnavailableError, a lost peer) instead of at their
    timeout, and say what failed to this node's ranks."""
    job, sequence = task.job, task.pending.sequence
    assert job.layout is not None
    where = {"job": job.name, "sequence": sequence}
    log.exception("collective failed unexpectedly across nodes", extra=where)
    node = job.layout.daemon(job.layout.node)
    failed = UnavailableError(
        f"collective #{sequence} of job {job.name!r} failed on node {node} with an internal error "
        f"({error!r}); the peer mesh was broken so that the other nodes fail it now, and is rebuilt"
    )
    link.endpoint.abort(failed)
    return failed


def notify_failure(job: Job, pending: Pending, error: LpsyncError, plane: PeerPlane) -> None:
    """This node failed ``pending`` before running it: take this node's part in the
    agreement with a summary that carries the error in place of the Spec, so that the
    other nodes fail it too instead of timing out (a timeout would break the mesh).
    Best effort: without a mesh there is nothing to tell."""
    if job.layout is None:
        return
    if job.native is not None:  # armed peers wait in the GO round: they fall back to hear it
        job.native.notice(pending.sequence, job.layout.node)
    try:
        link = plane.link(time.monotonic()).for_job(job.layout.cluster)
    except LpsyncError:
        return
    # The other nodes wait for this node as long as their own timeouts allow.
    timeout = min((a.timeout for a in pending.arrivals.values()), default=_NOTIFY_TIMEOUT)
    deadline = time.monotonic() + max(_NOTIFY_TIMEOUT, timeout)
    # The verdict names this error (or an earlier node's), or the mesh broke: either way
    # this node's participants already have their error.
    with contextlib.suppress(LpsyncError):
        agreement.agree(job, pending, link, deadline, agreement.failure_summary(job, error))


def _learn(learner: Learner, verdict: agreement.Verdict) -> None:
    """Node 0: the trial times the other nodes reported in their summaries."""
    for node, sequence, seconds in verdict.reports:
        learner.report(node, sequence, seconds)
