"""The finish stage of a multi-node collective (path.py): its Outcome, or the error every
node reports alike.

A collective the agreement finishes (a barrier, or a small one whose data rode it) is
finished here from its verdict: on the calling thread, or where the verdict lands
(agreement.py's leaves: the TCP reader, UCX's progress thread). A failed one reports
what broke: an internal error breaks the mesh, so that the other nodes fail it now
instead of at their timeout; a broken mesh says what broke it (a lost peer, a timeout).
Either way this call's part in node 0's learning is undone (learning.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lpsync.daemon.collectives import native_across
from lpsync.daemon.collectives.agreement import EXCHANGE_MAX_NODES, Verdict
from lpsync.daemon.collectives.learning import Learner
from lpsync.daemon.collectives.planning import Proposal
from lpsync.daemon.collectives.small import SmallCollective
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
    """What finishing ``task`` needs: its plane and link, node 0's learner, this node's
    last trial time (``last``, taken for the summary) and its proposal (None: not made
    yet)."""

    task: Task
    plane: PeerPlane
    link: Link
    learner: Learner
    last: tuple[int, float] | None = None
    proposal: Proposal | None = None

    def agreed(
        self, agreed: Verdict | Later[Verdict | Exception], ride: bool, small: SmallCollective | None
    ) -> Outcome | Later[Outcome] | None:
        """The verdict came: node 0 learns the trial times it carries, and the call runs.
        A collective the agreement finishes (``ride``: a barrier, or ``small`` riding it)
        is finished here: its Outcome, or a Later that the verdict's reader fills where
        the verdict lands (``agreed`` a Later: agreement.py's leaves). None: the call
        runs on the general path (runners.py)."""
        if isinstance(agreed, Later):
            return self._later(small, agreed)
        if not ride:
            self._running(agreed)
            return None
        task, outcome = self.task, self._ridden(small, agreed)
        if small is not None and not task.on_device:  # armed where every node offered
            outcome.armed = native_across.after_ride(task, self.plane, agreed)
        return outcome

    def _running(self, verdict: Verdict) -> None:
        """Node 0 takes the trial times the other nodes reported in their summaries."""
        for node, sequence, seconds in verdict.reports:
            self.learner.report(node, sequence, seconds)
        self.task.pending.enter(RUNNING)

    def _ridden(self, small: SmallCollective | None, verdict: Verdict) -> Outcome:
        """A collective the agreement finished (with the result of one riding it,
        ``small``; None: a barrier): write the result."""
        self._running(verdict)
        task = self.task
        if small is None:
            return Outcome(algorithm="exchange", chunks=1, seconds=task.elapsed())
        assert verdict.result is not None and task.job.layout is not None
        small.write(verdict.result)
        shape = "exchange" if task.job.layout.nodes <= EXCHANGE_MAX_NODES else "tree"
        return Outcome(algorithm=shape, chunks=1, seconds=task.elapsed())

    def _later(self, small: SmallCollective | None, agreed: Later[Verdict | Exception]) -> Later[Outcome]:
        """``_ridden`` where the verdict lands (never armed: no node offered to)."""
        finished: Later[Outcome] = Later()

        def then(verdict: Verdict | Exception) -> None:
            try:
                if isinstance(verdict, Exception):
                    raise verdict
                outcome = self._ridden(small, verdict)
            except Exception as error:  # on a reader thread: every error becomes the outcome
                outcome = Outcome(self.failed(error))
            finished.set(outcome)

        agreed.then(then)
        return finished

    def failed(self, error: Exception) -> LpsyncError:
        """The error a collective that failed across nodes with ``error`` reports: an
        internal error breaks the mesh; a broken mesh says what broke it (a lost peer, a
        timeout); anything else is ``error`` itself. Undoes this call's part in node 0's
        learning."""
        task, link, learner = self.task, self.link, self.learner
        job, pending = task.job, task.pending
        if self.proposal is not None and self.proposal.trial:
            learner.abandon(pending.sequence)
        if self.last is not None:
            learner.ran(*self.last)  # node 0 may not have it: it goes again with the next one
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
