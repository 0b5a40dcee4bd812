"""A collective's path through the daemon: one Task moving forward through its stages.

    matched (matching.py: every local participant arrived, specs agree; Task.matched)
      single node:  run (runners.py: native, direct, host pipeline or device chain) -> finished
      multi-node:   agreed   (agreement.py, one call for every branch: summaries up a
                              tree, node 0's verdict down; a small collective's data
                              rides it and is done there, as a barrier is; on a leaf,
                              where the verdict lands; a node that failed the call (no
                              mesh, its armed run failed) brings its error instead)
                    planned  (planning.py: the forced algorithm, node 0's learned choice
                              or the tuner's pick for the slowest link of all)
                    run      (runners.py's table, by the verdict: the plan bound to this
                              run's buffers, staged where they are on devices: local
                              stage -> inter-node chain -> local stage, one chunk pipeline;
                              hierarchy.py or packed.py where every node's buffers are on
                              devices: the device chain, a bounded host ring, the peers)
                    finished (finish.py: an Outcome, or the error every node reports
                              alike)
Each stage takes what the earlier ones produced and hands its own result on; none calls
back into another. A peer lost mid-way breaks the mesh and every waiting participant
fails at once with UnavailableError. So does every node when one of them fails with an
internal error (a bug, not an LpsyncError): the others wait on its part, and would wait
out their timeout, which breaks the mesh anyway; it breaks the mesh at once instead.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

from lpsync.daemon.collectives import agreement, hierarchy, native_across, planning, runners, small
from lpsync.daemon.collectives.finish import Finish
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.plane import Link, PeerPlane
from lpsync.daemon.values import Later, Outcome, Pending
from lpsync.errors import LpsyncError, UnavailableError
from lpsync.transport.tags import agreement_tags
from lpsync.types import Collective

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
    """The multi-node path, one descent: what this node brings -> agree (agreement.py,
    the one call for every branch) -> select and run (the agreement itself where the data
    rides it, else runners.py by the verdict) -> finish (finish.py). Each stage is
    called from here alone and none calls back."""
    job, pending, learner = task.job, task.pending, task.job.learner
    assert job.layout is not None and learner is not None
    deadline = time.monotonic() + task.timeout
    tags = agreement_tags(job.name, pending.sequence)  # made once here, handed down
    where: Link | PeerPlane = plane
    failed: LpsyncError | None = None  # this node's own failure: every node fails the call
    finish: Finish | None = None
    try:
        where = link = plane.link(deadline).for_job(job.layout.cluster)
    except UnavailableError as error:
        # No mesh (lost, or rebuilt while this waited): nodes whose new mesh is up by the
        # time their ranks arrive would wait out their timeout for this node's part; the
        # agreement owes it to the next mesh.
        failed = error
    try:
        # matched -> what this node brings: its armed side (native_across.py), its
        # devices' segment (hierarchy.py), whether its data rides the agreement (small.py).
        brought: tuple[tuple[str, Any], ...] = ()
        if failed is None:
            armed = native_across.before(task, plane)
            if isinstance(armed, LpsyncError):
                # Its armed run failed here: it fails on every node; the nodes that run
                # it on the general path learn it, bounded (an armed node never comes).
                failed, deadline = armed, time.monotonic() + _NOTIFY_TIMEOUT
            else:
                finish = Finish(plane, link, learner)
                brought = hierarchy.offer(task, devices) + armed
                # Finished once agreed: a barrier, or a collective whose data rides.
                finish.rides = task.op is Collective.BARRIER or small.rides(task)
        rides = finish is not None and finish.rides
        with small.riding(task, devices, deadline) if rides else contextlib.nullcontext() as ride:
            landed = None
            if finish is not None:
                # What node 0 learned (learning.py), and an earlier trial's time for it.
                finish.proposal = planning.propose(task, learner, link, rides)
                brought = finish.proposal.extras + brought
                # On this thread where it may be armed (arming may connect sockets) or
                # is staged from devices (the staging ends with this block); else where
                # the verdict lands (finish.landed, on that thread).
                if rides and not task.on_device and all(name != "native" for name, _ in brought):
                    landed = functools.partial(finish.landed, task, ride)
            # -> agreed (every branch: a node that failed brings its error instead)
            spec = task.spec if failed is None else None
            agreed = agreement.agree(
                agreement.Side(
                    job,
                    pending,
                    tags,
                    deadline,
                    spec=spec,
                    offers=brought,
                    error=failed,
                    ride=ride,
                    landed=landed,
                ),
                where,
            )
            assert finish is not None  # a failed side raised its error
            # -> finished, where the agreement was all of it (a barrier, a ride)
            finished = finish.agreed(task, agreed, ride)
            if finished is not None:
                return finished
        # -> selected and run by the verdict (runners.py); its Outcome is the finish
        assert agreed is not None  # only a riding collective's verdict lands later
        steps = planning.tag_base(job.name, pending.sequence)  # the schedule's message tags
        context = runners.Context(devices, link, agreed, learner, deadline, steps, plane)
        return runners.run_across(task, context)
    except Exception as error:
        if finish is None:  # this node's own failure, told to the others: raised as it is
            raise
        reported = finish.failed(task, error)  # a failed call: the job's channels start afresh
        if reported is error:
            raise
        raise reported from (error if not isinstance(error, LpsyncError) else None)


def notify_failure(job: Job, pending: Pending, error: LpsyncError, plane: PeerPlane) -> None:
    """This node failed ``pending`` before running it: take this node's part in the
    agreement with a summary that carries the error in place of the Spec, so that the
    other nodes fail it too instead of timing out (a timeout would break the mesh).
    Best effort: without a mesh there is nothing to tell."""
    if job.layout is None:
        return
    try:
        link = plane.link(time.monotonic()).for_job(job.layout.cluster)
    except LpsyncError:
        return
    # The other nodes wait for this node as long as their own timeouts allow.
    timeout = min((a.timeout for a in pending.arrivals.values()), default=_NOTIFY_TIMEOUT)
    deadline = time.monotonic() + max(_NOTIFY_TIMEOUT, timeout)
    side = agreement.Side(job, pending, agreement_tags(job.name, pending.sequence), deadline, error=error)
    # The verdict names this error (or an earlier node's), or the mesh broke: either way
    # this node's participants already have their error.
    with contextlib.suppress(LpsyncError):
        agreement.agree(side, link)
