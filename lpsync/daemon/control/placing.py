"""A job's first collectives wait here until its layout is settled (daemons with peers).

Every job that attaches to a daemon with peers opens here. Its collectives are held
(parked) until every rank of the job has attached to some daemon of the cluster, as the
daemons tell each other (peers/attached.py); then layout.placed judges where they did:
  * settled: a job that brought no hint takes the layout the daemons saw (Job.place;
    None where all its ranks are on this node), a hinted one keeps its own, and the
    parked collectives go on to matching, in their order;
  * a contradiction (a rank on two nodes, world sizes or hints that disagree with the
    daemons, a rank refused somewhere): every parked collective fails with it at once,
    and so does each later one while it stands;
  * ranks attached nowhere ``bound`` seconds (at most the collective's own timeout)
    after the first parked collective: they fail DEADLINE_EXCEEDED naming those ranks.
A settled job is closed here: its later collectives pass with one dict lookup. It opens
again, its collectives failing, when a contradiction comes later (a second process of one
of its ranks attaching elsewhere, a rank back on another node), until that ends.
Lock order: Placing._lock alone; jobs, sessions and replies are called with no lock held.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.control.layout import Hinted, Unplaced, placed
from lpsync.daemon.control.sessions import Session
from lpsync.daemon.peers.attached import Attached
from lpsync.daemon.values import INTACT, UNSPECIFIED, Arrival, Outcome, Waiting
from lpsync.daemon.watcher import Timer, Watcher
from lpsync.errors import AbortedError, CollectiveTimeoutError, InvalidArgumentError, LpsyncError

BOUND = 30.0  # seconds a collective waits for its job's ranks to attach somewhere
ATTACHING = "attaching"  # the stage Status shows for a parked collective


@dataclass
class _Open:
    job: Job
    hinted: Hinted | None  # what the job's first attach here said; None: nothing
    parked: list[tuple[Session, Arrival]] = field(default_factory=list)
    timer: Timer | None = None
    # The last contradiction seen: it stands while the job's ranks are not all attached
    # (the ranks it failed may have gone, taking its evidence with them).
    contradiction: InvalidArgumentError | None = None
    since: float = 0.0  # monotonic time of the oldest parked collective
    since_wall: float = 0.0


class Placing:
    def __init__(
        self,
        attached: Attached,
        watcher: Watcher,
        submit: Callable[[Session, Arrival], None],
        placed_job: Callable[[Job], None],
        find: Callable[[str], Job | None],
        bound: float = BOUND,
        on_failure: Callable[[str, str], object] | None = None,
    ) -> None:
        """``submit``: hand a released collective to matching (its errors are its own
        reply); ``placed_job``: a job's layout settled (before its collectives go on);
        ``find``: this daemon's job of a name (Jobs.get); ``on_failure``: (op, code) of
        each collective failed here (the error counter)."""
        self.node = attached.node
        self._attached, self._watcher, self._submit, self._find = attached, watcher, submit, find
        self._placed, self.bound, self._on_failure = placed_job, bound, on_failure
        # A contradiction outlives the job's last rank here for ``bound`` seconds: a rank
        # that attaches after the ones it failed left must fail with it too, not wait out
        # the bound for ranks that are gone (name -> (error, monotonic time)).
        self._recent: dict[str, tuple[InvalidArgumentError, float]] = {}
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._settled: weakref.WeakSet[Job] = weakref.WeakSet()  # never opened again
        attached.listen(self._changed)

    # -- membership ----------------------------------------------------------------------------
    def attached(self, job: Job, rank: int, hinted: Hinted | None) -> None:
        """``rank`` of ``job`` attached here (Jobs.join took it); tell the peers."""
        with self._lock:
            state = self._open.get(job.name)
            if (state is None or state.job is not job) and job not in self._settled:
                state = self._open[job.name] = _Open(job, hinted)  # a new job: open until settled
                recent = self._recent.pop(job.name, None)
                if recent is not None and time.monotonic() - recent[1] < self.bound:
                    state.contradiction = recent[0]
        self._attached.attached(job.name, job.world_size, rank)

    def left(self, name: str, rank: int, reason: str) -> None:
        """``rank`` left (``reason``): what waits here for its job fails as matching fails
        what waits on a rank that left; a job that ended with it closes."""
        with self._lock:
            state = self._open.get(name)
            if state is not None and not state.job.sessions:
                del self._open[name]
                if state.contradiction is not None:
                    self._recent[name] = (state.contradiction, time.monotonic())
                    now = time.monotonic()  # bounded: stale ones go as new ones come
                    for old in [n for n, (_, at) in self._recent.items() if now - at >= self.bound]:
                        del self._recent[old]
        if state is not None:
            self._fail(
                state,
                AbortedError(
                    f"rank {rank} of job {name!r} left ({reason}) before the job's layout was "
                    "settled; its collectives were abandoned"
                ),
            )
        self._attached.left(name, rank)

    def refused(self, name: str, world_size: int, rank: int, error: LpsyncError) -> None:
        self._attached.refused(name, world_size, rank, f"{error.code}: {error}")

    def settled(self, job: Job) -> bool:
        return job in self._settled

    # -- collectives ---------------------------------------------------------------------------
    def holds(self, job: Job, session: Session, arrival: Arrival) -> bool:
        """True: ``arrival`` waits here for the job's layout (or failed already)."""
        state = self._open.get(job.name)  # a settled job: no lock, one lookup
        if state is None:
            return False
        with self._lock:
            if self._open.get(job.name) is not state or state.job is not job:
                return False
            state.parked.append((session, arrival))
            if state.timer is None:
                state.since, state.since_wall = time.monotonic(), time.time()
                wait = min(self.bound, arrival.timeout)
                state.timer = self._watcher.at(state.since + wait, lambda: self._expire(state, wait))
        self._changed(job.name)
        return True

    def waiting(self, job: Job) -> list[Waiting]:
        """What the job's parked collectives wait for (Status): ranks attached nowhere."""
        state = self._open.get(job.name)
        if state is None or state.job is not job:
            return []
        with self._lock:
            parked = list(state.parked)
            since, since_wall = state.since, state.since_wall
        if not parked:
            return []
        seen = self._attached.seen(job.name)
        missing = tuple(r for r in range(job.world_size) if r not in seen.nodes_of)
        by_sequence: dict[int, list[Arrival]] = {}
        for _, arrival in parked:
            by_sequence.setdefault(arrival.sequence, []).append(arrival)
        now = time.monotonic()
        return [
            Waiting(
                seq,
                arrivals[0].spec.op,
                ATTACHING,
                since_wall,
                now - since,
                tuple(sorted(a.rank for a in arrivals)),
                missing,
                (),
                False,
            )
            for seq, arrivals in sorted(by_sequence.items())
        ]

    # -- settling ------------------------------------------------------------------------------
    def _changed(self, name: str) -> None:
        """What is known of job ``name`` changed: settle it, fail its parked collectives,
        or leave them waiting."""
        state = self._open.get(name)
        if state is None:
            self._recheck(name)
            return
        job = state.job
        try:
            verdict = placed(name, job.world_size, self.node, self._attached.seen(name), state.hinted)
        except LpsyncError as error:
            if isinstance(error, InvalidArgumentError):
                state.contradiction = error
            self._fail(state, error)
            return
        if isinstance(verdict, Unplaced):
            if state.contradiction is not None:
                self._fail(state, state.contradiction)
            return
        with self._lock:
            if self._open.get(name) is not state:
                return  # settled (or ended) meanwhile, by another thread
            # Placed before the job closes here: a collective that passes holds() once it
            # has must find the job's layout in place.
            if state.hinted is None:
                job.place(verdict)
            self._placed(job)
            self._settled.add(job)
            del self._open[name]
            parked, state.parked = state.parked, []
            if state.timer is not None:
                state.timer.cancel()
        for session, arrival in sorted(parked, key=lambda p: p[1].sequence):
            self._submit(session, arrival)

    def _recheck(self, name: str) -> None:
        """A settled job hears of a contradiction: it opens again (its collectives fail)."""
        job = self._find(name)
        if job is None or job not in self._settled:
            return
        settled = Hinted(job.layout, "the layout its ranks settled")
        try:
            placed(name, job.world_size, self.node, self._attached.seen(name), settled)
        except InvalidArgumentError:
            with self._lock:
                if name not in self._open and job in self._settled:
                    self._settled.discard(job)
                    self._open[name] = _Open(job, settled)
        except LpsyncError:
            pass  # a rank refused: matching fails what needs it (Job.leave, Job.gone)

    def _expire(self, state: _Open, waited: float) -> None:
        with self._lock:
            state.timer = None
        name = state.job.name
        try:
            verdict = placed(name, state.job.world_size, self.node, self._attached.seen(name), state.hinted)
        except LpsyncError as error:
            self._fail(state, error)
            return
        if not isinstance(verdict, Unplaced) or state.contradiction is not None:
            self._changed(name)  # settled just now, or failed by what still stands
            return
        shown = ", ".join(map(str, verdict.missing[:32])) + (", …" if len(verdict.missing) > 32 else "")
        self._fail(
            state,
            CollectiveTimeoutError(
                f"job {name!r}: rank(s) {shown} did not arrive: not attached to any daemon of "
                f"the cluster within {waited:g} s of the first collective (attached: "
                f"{verdict.where})"
            ),
        )

    def fail_open(self, name: str, failure: LpsyncError) -> None:
        """Fail what job ``name`` holds here now, if it is still open (not settled)."""
        state = self._open.get(name)
        if state is not None:
            self._fail(state, failure)

    def _fail(self, state: _Open, failure: LpsyncError) -> None:
        with self._lock:
            parked, state.parked = state.parked, []
            if state.timer is not None:
                state.timer.cancel()
                state.timer = None
        for _, arrival in parked:
            if self._on_failure is not None:
                self._on_failure(arrival.spec.op, failure.code)
            arrival.done(Outcome(failure, INTACT if arrival.in_place else UNSPECIFIED))
