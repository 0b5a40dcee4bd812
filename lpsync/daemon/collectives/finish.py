"""The finish stage of a multi-node collective (path.py): its Outcome, or the error every
node reports alike.

A collective the agreement finishes (a barrier, or a small one whose data rode it) is
finished here from its verdict: on the calling thread, or where the verdict lands
(agreement.py's leaves: the TCP reader, UCX's progress thread, which call ``landed``).
One that runs on the general path leaves here running (runners.py). A failed one
reports what broke: an internal error breaks the mesh, so that the other nodes fail it
now instead of at their timeout; a broken mesh says what broke it (a lost peer, a
timeout). Either way this call's part in node 0's learning is undone (learning.py), and
a call that failed on this node's thread drops the job's armed channels
(native_across.py), which a ride that rode the agreement then arms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lpsync.daemon.collectives import native_across
from lpsync.daemon.collectives.agreement import EXCHANGE_MAX_NODES, Verdict
from lpsync.daemon.collectives.learning import Learner
from lpsync.daemon.collectives.planning import Proposal
from lpsync.daemon.collectives.ride import Ride
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.peers.plane import Link, PeerPlane
from lpsync.daemon.values import RUNNING, Later, Outcome
from lpsync.errors import CollectiveTimeoutError, LpsyncError, MismatchError, UnavailableError

log = logging.getLogger("lpsync.daemon")

# Nodes that the loss did not cut off may have finished it (the verdict or the data had
# reached them): a report, not a second agreement round (outcomes.py says why).
_MAY_HAVE_FINISHED = (
    "; other nodes may have finished it: `lpsync status` on any node names each node's "
    "outcome once the mesh is back"
)


@dataclass
class Finish:
    """What finishing a task needs beside it: its plane and link, node 0's learner (the
    job's), this node's proposal (None: not made yet), whether it rides the agreement
    (``rides``: a barrier, or a Ride's data) and the Outcome a reader brings where the
    verdict lands there (``landed``)."""

    plane: PeerPlane
    link: Link
    learner: Learner
    proposal: Proposal | None = None
    rides: bool = False
    later: Later[Outcome] = field(default_factory=Later)

    def agreed(
        self, task: Task, agreed: Verdict | None, ride: Ride | None
    ) -> Outcome | Later[Outcome] | None:
        """``task``'s verdict came (None: it lands on a reader, ``landed``): the call
        runs, or the agreement finished it (``rides``; ``ride`` the data that rode): its
        Outcome, armed where every node offered to. None: the call runs on the general
        path (runners.py)."""
        if agreed is None:
            return self.later
        outcome = self._ran(task, agreed, ride)
        if outcome is not None:  # armed where every node offered to (a ride on host buffers)
            outcome.armed = self._after(task, agreed, ride)
        return outcome

    def _ran(self, task: Task, verdict: Verdict, ride: Ride | None) -> Outcome | None:
        """Node 0 takes the trial times the other nodes reported in their summaries, and
        the call runs; one the agreement finished has its result written (``ride``)."""
        for node, sequence, seconds in verdict.reports:
            self.learner.report(node, sequence, seconds)
        task.pending.enter(RUNNING)
        if not self.rides:
            return None
        if ride is None:  # a barrier: the agreement was all of it
            return Outcome(algorithm="exchange", chunks=1, seconds=task.elapsed())
        assert verdict.result is not None and task.job.layout is not None
        ride.write(verdict.result)
        shape = "exchange" if task.job.layout.nodes <= EXCHANGE_MAX_NODES else "tree"
        return Outcome(algorithm=shape, chunks=1, seconds=task.elapsed())

    def landed(self, task: Task, ride: Ride | None, verdict: Verdict | Exception) -> None:
        """``agreed`` where the verdict lands, on the reader that agreement.agree_later
        hands it to (never armed: no node offered to); ``later`` brings the Outcome."""
        try:
            if isinstance(verdict, Exception):
                raise verdict
            outcome = self._ran(task, verdict, ride)
            assert outcome is not None  # only a riding collective's verdict lands later
        except Exception as error:  # on a reader thread: every error becomes the outcome
            outcome = Outcome(self._reported(task, error))
        self.later.set(outcome)

    def failed(self, task: Task, error: Exception) -> LpsyncError:
        """The error ``task``, which failed across nodes with ``error`` on this node's
        thread, reports (``_reported``); the job's armed channels start afresh."""
        reported = self._reported(task, error)
        self._after(task, None, None)
        return reported

    def _after(self, task: Task, verdict: Verdict | None, ride: Ride | None) -> tuple[str, int, int] | None:
        """The finish stage's one look at armed plans after the call (native_across.py):
        ``task``'s ride armed (``verdict``), or, failed (None), the job's channels gone."""
        return native_across.after(task, self.plane, verdict, ride)

    def _reported(self, task: Task, error: Exception) -> LpsyncError:
        """The error a collective that failed across nodes with ``error`` reports: an
        internal error breaks the mesh; a broken mesh says what broke it (a lost peer, a
        timeout); anything else is ``error`` itself. Undoes this call's part in node 0's
        learning."""
        link, learner, proposal = self.link, self.learner, self.proposal
        job, pending = task.job, task.pending
        if proposal is not None and proposal.trial:
            learner.abandon(pending.sequence)
        if proposal is not None and proposal.last is not None:
            learner.ran(*proposal.last)  # node 0 may not have it: it goes again with the next one
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
