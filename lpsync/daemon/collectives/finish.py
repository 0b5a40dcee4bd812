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

from lpsync.daemon.collectives.agreement import EXCHANGE_MAX_NODES, Verdict
from lpsync.daemon.collectives.learning import Learner
from lpsync.daemon.collectives.planning import Proposal
from lpsync.daemon.collectives.small import SmallCollective
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.peers.plane import Link
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
    """What finishing ``task`` needs: its link, node 0's learner, this node's last trial
    time (``last``, taken for the summary) and its proposal (None: not made yet)."""

    task: Task
    link: Link
    learner: Learner
    last: tuple[int, float] | None = None
    proposal: Proposal | None = None

    def agreed(self, verdict: Verdict) -> None:
        """The verdict came: node 0 learns the trial times it carries; the call runs."""
        for node, sequence, seconds in verdict.reports:
            self.learner.report(node, sequence, seconds)
        self.task.pending.enter(RUNNING)

    def ridden(self, small: SmallCollective | None, verdict: Verdict) -> Outcome:
        """A collective the agreement finishes (with the result of one riding it,
        ``small``; None: a barrier): its verdict came, write the result."""
        self.agreed(verdict)
        task = self.task
        if small is None:
            return Outcome(algorithm="exchange", chunks=1, seconds=task.elapsed())
        assert verdict.result is not None and task.job.layout is not None
        small.write(verdict.result)
        shape = "exchange" if task.job.layout.nodes <= EXCHANGE_MAX_NODES else "tree"
        return Outcome(algorithm=shape, chunks=1, seconds=task.elapsed())

    def later(self, small: SmallCollective | None, agreed: Later[Verdict | Exception]) -> Later[Outcome]:
        """``ridden`` where the verdict lands (agreement.py's leaves)."""
        finished: Later[Outcome] = Later()

        def then(verdict: Verdict | Exception) -> None:
            try:
                if isinstance(verdict, Exception):
                    raise verdict
                outcome = self.ridden(small, verdict)
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
