"""Armed plans across nodes: when a multi-node collective may run natively, and how.

The general path's summary offers it (``_offer``) where this node could: the engine is
built and the job may run natively (--native), the peer transport is TCP (the engine's
channels are TCP sockets), the buffers are host memory, and the collective is pipelined
(not a barrier): ``before``, the multi-node path's one look at armed plans before the
agreement. Where every node offered, the verdict carries every node's channel address;
after a run that succeeded (``after_run``: the pipeline's; ``after``: a small
collective's that rode the agreement, the finish stage's one look after it):
  - channels not connected everywhere: each node connects the job's (a lower node dials
    every higher one, peers/native_channels.py); the next identical call's verdict says
    they are;
  - connected: each node compiles its part of the plan it just ran (lpsync/native/
    across.py: the same schedule, the schedule stays the one source of truth) and arms
    it; the reply tells its ranks, whose next identical call rings the doorbell.
Node 0's trials of a schedule (learning.py) are not armed: an armed plan is the settled one.

A node whose ranks take the general path for a call while the job has channels says so
first (``notice``): armed peers fall back at once, nothing written (the engine's GO
round), and the call runs on the general path everywhere, which names any difference.
A call that failed across nodes drops the job's channels (``after`` without a verdict).
An armed run that failed after its GO round (a peer lost, a timeout, a message of
another call) is ``failure``'s: the engine records the code and the node, the ranks send
the call the general way, and it fails there with the error of docs/reliability.md,
which the other nodes learn as any failure (path.notify_failure).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from lpsync.algorithms import generate, select
from lpsync.algorithms.cost import busbw_factor
from lpsync.algorithms.schedule import Schedule
from lpsync.daemon.collectives.plans import plan_key
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import buffers, reduction
from lpsync.errors import CollectiveTimeoutError, LpsyncError, MismatchError, UnavailableError
from lpsync.native import LOST, MISMATCH, TIMEOUT
from lpsync.native import engine as native_engine
from lpsync.native.across import MAX_NODES, STAR_OPS, compile_node, star
from lpsync.reduction import Reduction
from lpsync.transport.addresses import PeerAddress
from lpsync.types import Collective

if TYPE_CHECKING:
    from lpsync.daemon.collectives.agreement import Verdict
    from lpsync.daemon.collectives.ride import Ride
    from lpsync.daemon.peers.plane import PeerPlane

log = logging.getLogger("lpsync.daemon")

MAX_BYTES = 256 << 20  # per participant: the plan's scratch holds what the node receives
_CONNECT_SECONDS = 5.0
_RETRY_AFTER = 60.0  # seconds without offers after connecting the channels failed
_MAY_HAVE_FINISHED = (
    "; other nodes may have finished it: `lpsync status` on any node names each node's "
    "outcome once the mesh is back"
)


def before(task: Task, plane: PeerPlane) -> LpsyncError | tuple[tuple[str, Any], ...]:
    """This node's armed side of a call before its agreement (the path's one look at it
    there): the error of its armed run that failed here (``failure``; the job's channels
    go, and it fails on every node), or, the call running on the general path here
    (armed peers fall back at once: ``notice``), this node's offer for the summary."""
    failed = failure(task)
    if failed is not None:
        drop(task)
        return failed
    notice(task)
    return _offer(task, plane)


def _offer(task: Task, plane: PeerPlane) -> tuple[tuple[str, Any], ...]:
    """This node's summary field: ("native", (host, port, channels connected)), or none."""
    job = task.job
    layout = job.layout
    if (
        layout is None
        or task.on_device
        or task.op is Collective.BARRIER
        or task.nbytes > MAX_BYTES
        or layout.nodes > MAX_NODES
        or native_engine() is None
        or time.monotonic() < job.native_retry_at
    ):
        return ()
    channels = plane.native_channels()
    if channels is None:
        return ()
    native = job.native_plans()
    if native is None:
        return ()
    ready = native.channels >= {n for n in range(layout.nodes) if n != layout.node}
    return (("native", (channels.address.host, channels.address.port, ready)),)


def notice(task: Task) -> None:
    """This node runs the call on the general path: armed peers fall back at once."""
    if task.job.native is not None and task.job.layout is not None:
        task.job.native.notice(task.pending.sequence, task.job.layout.node)


def drop(task: Task) -> None:
    """The call failed: the job's channels and plans with messages go (fresh ones later)."""
    if task.job.native is not None and task.job.native.channels:
        task.job.native.drop_net()


Armed = tuple[str, int, int]  # the reply's (doorbell page, plan, generation)
Views = list[tuple[np.ndarray, np.ndarray]]
ViewsOf = Callable[[], tuple[Views, Reduction | None]]  # asked only to compile a new plan


def after(task: Task, plane: PeerPlane, verdict: Verdict | None, ride: Ride | None) -> Armed | None:
    """This node's armed side of a call after it (finish.py: the path's one look at it
    there): a call that failed (``verdict`` None) drops the job's channels (``drop``); a
    small collective that rode the agreement (``ride``, host buffers) is armed as a star
    on the GO round (its native twin, lpsync/native/across.py), or for the ops a star
    does not serve as the schedule the tuner picks on the agreed link model (the same on
    every node)."""
    if verdict is None:
        drop(task)
        return None
    if ride is None or task.on_device or not _armable(task, plane, verdict):
        return None
    return _arm(task, verdict, None, lambda: (ride.buffers, ride.reduction))


def after_run(
    task: Task, plane: PeerPlane, verdict: Verdict, schedule: Schedule, algorithm: str, chunks: int
) -> Armed | None:
    """After a run of ``schedule`` that succeeded (runners.py's pipeline, host buffers):
    connect the channels or arm its plan, as the verdict allows; the Armed reply once
    armed."""
    if not _armable(task, plane, verdict):
        return None

    def views_of() -> tuple[Views, Reduction | None]:
        p = task.participants
        views = cast("Views", [buffers(task.spec, a, p) for a in task.arrivals])
        return views, reduction(task.spec, task.dtype, p)

    return _arm(task, verdict, (schedule, algorithm, chunks), views_of)


def _armable(task: Task, plane: PeerPlane, verdict: Verdict) -> bool:
    """Whether the call may be armed now: every node offered, not one of node 0's trials
    (an armed plan is the settled one), and the job's channels connected everywhere;
    where they are not, each node connects them now (``_connect``) and the next identical
    call's verdict says they are."""
    if not verdict.native or verdict.trial or task.job.native is None or task.job.layout is None:
        return False
    if not verdict.native_ready:
        _connect(task, plane, verdict)
        return False
    return True


def _arm(
    task: Task, verdict: Verdict, ran: tuple[Schedule, str, int] | None, views_of: ViewsOf
) -> Armed | None:
    """Arm this node's part of the call's plan (``ran``: the schedule that ran, with its
    algorithm and chunks; None: a ride's, a star or the tuner's pick), compiled the first
    time; the Armed reply."""
    job, layout, native, spec = task.job, task.job.layout, task.job.native, task.spec
    assert layout is not None and native is not None
    if ran is not None:
        schedule, algorithm, chunks = ran
    elif task.op in STAR_OPS:
        schedule, algorithm, chunks = None, "star", 1
    else:
        choice = select(task.op, task.nbytes, task.participants, verdict.model)
        schedule, algorithm, chunks = None, choice.algorithm, choice.chunks
    key = plan_key(spec, ("across", algorithm, chunks), task.arrivals)
    plan = native.find(key)
    if plan is None:
        views, reduce = views_of()
        if algorithm == "star":
            compiled = star(task.op, spec.count, spec.root, layout.node_of, layout.node, views, reduce)
        else:
            if schedule is None:
                schedule = generate(task.op, algorithm, task.participants, spec.count, spec.root, chunks)
            compiled = compile_node(schedule, layout.node_of, layout.node, views, reduce)
        if compiled is None:
            return None
        series = (spec.op, algorithm, spec.dtype, task.nbytes, busbw_factor(task.op, task.participants))
        handles = tuple(h for a in task.arrivals for h in a.handles)
        flat = [v for pair in views for v in pair]
        # The plan's key in every message header: the same on every node, never 0.
        text = repr((job.name, tuple(spec), algorithm, chunks, layout.node_of)).encode()
        net_key = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1
        plan = native.arm(key, compiled.program, flat, task.timeout, handles, series, spec, net_key=net_key)
        if plan is None:
            return None
        log.info(
            "collective armed across nodes",
            extra={"job": job.name, "op": spec.op, "algorithm": algorithm, "count": spec.count},
        )
        job.plans.drop_others(key)
    return plan.reply


def failure(task: Task) -> LpsyncError | None:
    """The error of the call whose armed run failed on this node (None: it did not)."""
    job, native = task.job, task.job.native
    if native is None or job.layout is None:
        return None
    failed = native.failure(task.pending.sequence)
    if failed is None:
        return None
    code, node = failed
    peer = f"node {job.layout.daemon(node)}" if 0 <= node < job.layout.nodes else "a peer node"
    head = f"collective #{task.pending.sequence} of job {job.name!r}"
    if code == TIMEOUT:
        return CollectiveTimeoutError(
            f"{head} timed out across nodes: {peer} did not answer its armed plan within {task.timeout:g} s"
        )
    if code == MISMATCH:
        return MismatchError(
            f"{head}: {peer} sent a message of another collective than this node's armed "
            f"{task.spec.op} (its ranks called another collective or sequence number)"
        )
    what = "lost" if code == LOST else f"failed ({code})"
    return UnavailableError(
        f"{head} lost a peer node: {peer}'s channel of the armed plan {what}{_MAY_HAVE_FINISHED}"
    )


def _connect(task: Task, plane: PeerPlane, verdict: Verdict) -> None:
    """Connect the job's channels afresh (some node has none, or lost them): dial every
    higher node, take every lower one's dial. Every node does it for the same verdict."""
    job, layout, native = task.job, task.job.layout, task.job.native
    channels = plane.native_channels()
    assert layout is not None and native is not None
    if channels is None:
        return
    if native.channels:  # ours may lead to a node that dropped its own
        native.drop_net()
    deadline = time.monotonic() + _CONNECT_SECONDS
    try:
        for other in range(layout.node + 1, layout.nodes):
            host, port = verdict.native[other]
            address = PeerAddress(host, port)
            native.connect(
                other, channels.dial(job.name, layout.node, address, layout.daemon(other), deadline)
            )
        for other in range(layout.node):
            sock = channels.accept(job.name, other, deadline)
            if sock is None:
                raise TimeoutError(
                    f"node {layout.daemon(other)} did not connect within {_CONNECT_SECONDS:g} s"
                )
            native.connect(other, sock)
    except (OSError, LpsyncError) as error:
        native.drop_net()
        job.native_retry_at = time.monotonic() + _RETRY_AFTER
        log.warning(
            "the job's armed plans stay on the general path: connecting their channels failed: %s",
            error,
            extra={"job": job.name},
        )
