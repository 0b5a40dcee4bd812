"""The job's run order on its own (matching.Job, no daemon): whichever order collectives
complete in and whichever dispatched run gets to the job first, they run by sequence
number. The end-to-end check through real daemons is test_issue_order.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.values import Arrival, Outcome, Pending, Spec
from lpsync.daemon.watcher import Watcher
from lpsync.errors import LpsyncError


def _arrival(rank: int, seq: int, outcomes: list) -> Arrival:
    spec = Spec("barrier", "float32", 0, 0, "", "", "")
    return Arrival(rank, seq, spec, 30.0, None, None, (), lambda o: outcomes.append((rank, seq, o)))


def test_runs_take_the_lowest_complete_sequence_first() -> None:
    watcher = Watcher()
    ran: list[int] = []
    thunks: list[Callable[[], None]] = []
    outcomes: list = []

    class Runner:  # a matching.JobRunner that runs each collective when the test says
        def dispatch(self, job: Job, pending: Pending, run: Callable[[], None]) -> None:
            thunks.append(run)

        def run(self, job: Job, pending: Pending) -> Outcome:
            ran.append(pending.sequence)
            return Outcome()

        def finished(self, job: Job, pending: Pending, outcome: Outcome) -> None:
            pass

        def failed_here(self, job: Job, pending: Pending, error: LpsyncError) -> None:
            pass

    job = Job("j", 2, watcher, Runner())
    try:
        # Sequence 3 completes first, then 1, then 2 (as arrivals of three streams may).
        for seq in (3, 1, 2):
            job.submit(_arrival(0, seq, outcomes))
            job.submit(_arrival(1, seq, outcomes))
        assert len(thunks) == 3 and ran == []
        # The runs start in the opposite order, each on its own thread, one at a time.
        for run in reversed(thunks):
            t = threading.Thread(target=run)
            t.start()
            t.join(10)
        assert ran == [1, 2, 3]
        assert sorted((r, s) for r, s, o in outcomes if o.error is None) == [
            (r, s) for r in (0, 1) for s in (1, 2, 3)
        ]
    finally:
        watcher.stop()
