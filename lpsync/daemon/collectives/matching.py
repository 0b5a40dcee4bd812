"""Matching: the participants of one job meet at each collective by sequence number.

Every participant issues its collectives in the same order and numbers them; the
first arrival of a sequence number opens a Pending collective, each later arrival is
checked against it (op, count, dtype, root, reduce-op, algorithm, name) and the last
one queues it. Complete collectives run one at a time in sequence order (DESIGN:
overlapping buffers in issue order): each completion dispatches one run, and every run
takes the lowest queued sequence number, whichever thread gets there first. Failures:
  * a field differs  -> MismatchError to every arrived participant at once, and to the
    late ones when they come (the sequence number is remembered as failed);
  * the first arrival's timeout passes -> CollectiveTimeoutError naming the missing ranks;
  * a participant's session ends -> AbortedError to everyone waiting in the job, and
    every later collective of the job fails at once until that rank attaches again;
  * a participant cancels its call while others still arrive -> AbortedError to every
    participant of that collective (``withdraw``), so nothing waits for its timeout.
The flight recorder: each Job keeps its last collectives (FlightRecord: arrival times,
stage times, outcome) and knows what it still waits for (``waiting()``); a collective
still waiting on ranks past the stall threshold logs a warning naming them, once.
Lock order: Job.lock is taken alone; the JobRunner and replies are called with no lock held.
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lpsync.daemon.collectives.learning import Learner
from lpsync.daemon.collectives.plans import GroupCache
from lpsync.daemon.values import (
    AGREEING,
    ARRIVING,
    INTACT,
    PARTIAL,
    QUEUED,
    RUNNING,
    UNSPECIFIED,
    Arrival,
    FlightRecord,
    Later,
    NodeLayout,
    Outcome,
    Pending,
    Waiting,
    ranks_text,
)
from lpsync.daemon.watcher import Timer, Watcher
from lpsync.errors import (
    AbortedError,
    AlreadyExistsError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    ResourceExhaustedError,
)
from lpsync.native.armed import ArmedPlans, monotonic_to_wall

log = logging.getLogger("lpsync.daemon")

_REMEMBERED_FAILURES = 64


class JobRunner(Protocol):
    """What a job hands its complete collectives to (conductor.Conductor in the daemon):
    one object, so that matching never calls back into whoever built the job."""

    def dispatch(self, job: Job, pending: Pending, run: Callable[[], None]) -> None:
        """Where a complete collective runs: call ``run`` inline or on another thread."""

    def run(self, job: Job, pending: Pending) -> Outcome | Later[Outcome]:
        """Run it (path.py): each rank's outcome, or the Later that the thread receiving
        its last message sets."""

    def finished(self, job: Job, pending: Pending, outcome: Outcome) -> None:
        """It finished (ran or failed): keep what is kept of it (metrics, Status)."""

    def failed_here(self, job: Job, pending: Pending, error: LpsyncError) -> None:
        """It failed on this node before it could run (a mismatch, a local rank missing or
        gone): a multi-node job's other nodes must fail it too instead of waiting."""

    def native_plans(self, job: Job) -> ArmedPlans | None:
        """The job's armed plans (lpsync/native), asked once, at its first plan armed, of
        a job that may run natively; None: it runs on Python only."""


class Job:
    def __init__(
        self,
        name: str,
        world_size: int,
        watcher: Watcher,
        runner: JobRunner,
        layout: NodeLayout | None = None,
        recorder: Recorder | None = None,
        max_pending: int = 4096,
        native: bool = False,
    ) -> None:
        self.name, self.world_size = name, world_size
        # A multi-node job: the ranks this daemon serves; its collectives run when these
        # arrived (path.py agrees with the other nodes before data moves).
        self.layout = layout
        # Single node: a range, never a materialized tuple (the world size is what a request
        # claimed; state grows only with what attached, limits.py). Multi-node: the layout's
        # ranks of this node, which its attaches carried.
        self.local_ranks: Sequence[int] = layout.local_ranks if layout is not None else range(world_size)
        self.max_pending = max_pending
        self.lock = threading.Lock()
        # One collective of a job runs at a time, the lowest queued sequence number first.
        # Released by the thread that finishes it: a multi-node one may finish on a peer
        # connection's reader (a Later), not on the thread that started it.
        self._run_lock = threading.Lock()
        self._queued: list[tuple[int, Pending]] = []  # complete, not yet running: a heap
        self.sessions: dict[int, str] = {}  # rank -> session id
        self.gone: dict[int, str] = {}  # rank -> why it left
        self._pending: dict[int, Pending] = {}
        self._active: dict[int, Pending] = {}  # complete, queued or running (under lock)
        self.recorder = recorder or Recorder()
        self.history: deque[FlightRecord] = deque(maxlen=self.recorder.size)
        self._failed: OrderedDict[int, LpsyncError] = OrderedDict()
        self._watcher, self._runner = watcher, runner
        # One timer per job checks for stalls (_stall_sweep), armed while a collective that
        # may stall is open: a timer set and cancelled per collective cost every call.
        self._stall_watch: Timer | None = None
        self.plans = GroupCache()  # this job's built plans, reused across calls (plans.py)
        # The native path (lpsync/native): the job's armed plans, made by the runner at the
        # first plan armed where ``native`` (None: this daemon or job runs on Python only).
        self.native: ArmedPlans | None = None
        self.native_retry_at = 0.0  # no armed plans across nodes before (native_across.py)
        self._native = native
        # Multi-node: what node 0 learned (learning.py), one per layout (path.py uses it).
        self.learner: Learner | None = Learner(layout.nodes) if layout is not None else None
        # For metrics (read at scrape time): the unix time the job last completed a
        # collective (its creation before that).
        self.last_progress = time.time()

    def native_plans(self) -> ArmedPlans | None:
        """The job's armed plans, made on first use where the job may run natively."""
        if self.native is None and self._native:
            with self.lock:
                if self.native is None and self.sessions:
                    self.native = self._runner.native_plans(self)
                    if self.native is None:
                        self._native = False  # not for this job: never asked again
        return self.native

    def _record_in_order(self, record: FlightRecord) -> None:
        """Keep ``record`` in the flight recorder in sequence order (under the lock): the
        engine's newer records may have been brought in before this one was answered."""
        history = self.history
        if not history or history[-1].sequence <= record.sequence:
            history.append(record)
            return
        merged = sorted((*history, record), key=lambda r: r.sequence)
        history.clear()
        history.extend(merged[-self.recorder.size :])

    def native_finished(self) -> list[FlightRecord]:
        """Bring what the engine answered since the last call into the flight recorder
        (at a scrape and at ``lpsync status``: never per call); the records added."""
        if self.native is None:
            return []
        records: list[FlightRecord] = []
        finished = 0.0
        for seq, spec, algorithm, code, first, last, done in self.native.sync():
            if spec is None or code != 0:  # fallbacks and failures finish on the general path
                continue
            wall, finished = monotonic_to_wall(first), monotonic_to_wall(done)
            stages = ((ARRIVING, last - first), ("native", done - last))
            records.append(FlightRecord(seq, spec, wall, (), stages, done - first, algorithm, 1, "OK", ""))
        if records:
            with self.lock:
                # In sequence order: a general-path record kept meanwhile may be newer.
                merged = sorted((*self.history, *records), key=lambda r: r.sequence)
                self.history.clear()
                self.history.extend(merged[-self.recorder.size :])
                self.last_progress = max(self.last_progress, finished)
        return records

    def close(self) -> None:
        """The job ended: its plans go (armed ones first: their rings fall back)."""
        if self.native is not None:
            self.native.close()
        self.plans.close()

    # -- membership ---------------------------------------------------------------------
    def join(self, rank: int, world_size: int, session_id: str) -> None:
        with self.lock:
            if world_size != self.world_size:
                raise InvalidArgumentError(
                    f"job {self.name!r} has world size {self.world_size}; rank {rank} "
                    f"attached with {world_size}"
                )
            if rank not in self.local_ranks:
                assert self.layout is not None  # a single-node job serves every rank
                raise InvalidArgumentError(
                    f"rank {rank} of job {self.name!r} belongs to node "
                    f"{self.layout.node_of[rank]}, not to this node {self.layout.node} (it serves "
                    f"{ranks_text(self.local_ranks)})"
                )
            if rank in self.sessions:
                raise AlreadyExistsError(
                    f"rank {rank} of job {self.name!r} is already attached; detach it first "
                    "or use another job name"
                )
            self.sessions[rank] = session_id
            self.gone.pop(rank, None)

    def place(self, layout: NodeLayout | None) -> None:
        """The job's layout, as the daemons found it (control/placing.py), before any of its
        collectives reached matching: until then it served every rank as if local."""
        if self.native is not None and layout != self.layout:
            self.native.disarm_all()  # armed for the old layout
            self.native.drop_net()
            self.native.activate(layout.local_ranks if layout is not None else range(self.world_size))
        with self.lock:
            if layout is None or self.learner is None or layout != self.layout:
                self.learner = Learner(layout.nodes) if layout is not None else None
            self.layout = layout
            self.local_ranks = layout.local_ranks if layout is not None else range(self.world_size)

    def leave(self, rank: int, reason: str) -> bool:
        """Remove ``rank``; abort what waits on it. True when the job has no ranks left."""
        if self.native is not None:
            self.native.disarm_all()  # rings waiting on the rank that left fall back
        with self.lock:
            self.sessions.pop(rank, None)
            if self.sessions:
                self.gone[rank] = reason
            failed = list(self._pending.values())
            self._pending.clear()
            error = AbortedError(
                f"rank {rank} of job {self.name!r} left ({reason}); its collectives were abandoned"
            )
            for pending in failed:
                self._remember(pending.sequence, error)
            empty = not self.sessions
        for pending in failed:
            self._fail(pending, error)
        return empty

    # -- matching ---------------------------------------------------------------------------
    def submit(self, arrival: Arrival) -> None:
        """Add one participant's request; runs the collective if it is the last one."""
        ready = None
        error: LpsyncError | None = None
        failed_pending: Pending | None = None
        arrival.at = time.monotonic()
        if self.native is not None:  # rings of this sequence number fall back to here
            self.native.yield_seq(arrival.sequence)
        with self.lock:
            seq = arrival.sequence
            if seq in self._failed:
                error = self._failed[seq]
            elif self.gone:
                ranks = ", ".join(f"{r} ({why})" for r, why in sorted(self.gone.items()))
                error = AbortedError(
                    f"job {self.name!r} lost rank(s) {ranks}; collective #{seq} cannot run "
                    "until they attach again"
                )
                # Failed for every local rank (remembered), and through _fail the other
                # nodes learn it at once (JobRunner.failed_here) instead of waiting out their
                # timeout for this node's part (seen in the chaos run: a killed trainer).
                failed_pending = self._pending.pop(seq, None) or Pending(seq, arrival.spec, opened=arrival.at)
                failed_pending.arrivals[arrival.rank] = arrival
                self._remember(seq, error)
            else:
                pending = self._pending.get(seq)
                if pending is None and len(self._pending) >= self.max_pending:
                    error = ResourceExhaustedError(
                        f"job {self.name!r} has {len(self._pending)} collectives waiting for "
                        f"participants, its limit (--max-pending {self.max_pending}); "
                        f"collective #{seq} was refused"
                    )
                    # The other ranks get the same answer for this sequence number, so the
                    # job's numbering stays aligned.
                    self._remember(seq, error)
                elif pending is None:
                    pending = Pending(seq, arrival.spec, opened=arrival.at)
                    self._pending[seq] = pending
                    if self.recorder.stall_seconds >= arrival.timeout:
                        pending.stall_checked = True  # it fails before it could stall
                    elif self._stall_watch is None:
                        self._stall_watch = self._watcher.at(
                            pending.opened + self.recorder.stall_seconds, self._stall_sweep
                        )
                if pending is None:
                    pass
                elif arrival.rank in pending.arrivals:
                    error = InvalidArgumentError(f"rank {arrival.rank} submitted collective #{seq} twice")
                else:
                    pending.arrivals[arrival.rank] = arrival
                    if arrival.at < pending.opened:
                        # Stamped before the arrival that opened it, which reached the lock
                        # first: the collective opened at the earliest (stages never < 0).
                        pending.opened_wall -= pending.opened - arrival.at
                        pending.opened = arrival.at
                    # Equal to the first arrival's spec: all agree (the first: no check).
                    same = arrival.spec is pending.spec or arrival.spec == pending.spec
                    error = None if same else self._check(pending)
                    if error is not None:
                        del self._pending[seq]
                        self._remember(seq, error)
                        failed_pending = pending
                    elif len(pending.arrivals) == len(self.local_ranks):
                        del self._pending[seq]
                        self._active[seq] = pending
                        pending.enter(QUEUED, arrival.at)
                        heapq.heappush(self._queued, (seq, pending))
                        ready = pending
                    elif pending.timer is None:
                        pending.timer = self._watcher.at(
                            arrival.at + arrival.timeout, functools.partial(self._expire, pending)
                        )
        if failed_pending is not None:
            assert error is not None
            self._fail(failed_pending, error)
        elif error is not None:
            arrival.done(Outcome(error, INTACT if arrival.in_place else UNSPECIFIED))
        elif ready is not None:
            if ready.timer is not None:
                ready.timer.cancel()
            self._runner.dispatch(self, ready, self._run_next)

    def withdraw(self, rank: int, sequence: int, why: str, arrival: Arrival | None = None) -> bool:
        """``rank`` gave up on collective ``sequence`` (a cancelled call; ``arrival``: that
        call's own, when known): if it is still waiting for participants, fail it now for
        everyone, and for the late ones when they come, instead of holding it until its
        timeout. One that is queued or running completes (its reply is dropped). True when
        it was withdrawn."""
        with self.lock:
            pending = self._pending.get(sequence)
            mine = None if pending is None else pending.arrivals.get(rank)
            if mine is None or (arrival is not None and mine is not arrival):
                return False
            assert pending is not None  # mine is one of its arrivals
            del self._pending[sequence]
            error = AbortedError(
                f"collective #{sequence} ({pending.spec.op}) of job {self.name!r} was "
                f"abandoned: rank {rank} {why} before every rank had arrived"
            )
            self._remember(sequence, error)
        self._fail(pending, error)
        return True

    # -- the flight recorder ------------------------------------------------------------------
    def _stall_sweep(self) -> None:
        """The job's stall watch fired: check each open collective once, at its threshold,
        and arm the watch again for the next one due."""
        now, stall = time.monotonic(), self.recorder.stall_seconds
        with self.lock:
            unfinished = [*self._pending.values(), *self._active.values()]
            due = [p for p in unfinished if not p.stall_checked and now >= p.opened + stall]
            for pending in due:
                pending.stall_checked = True
            later = [p.opened for p in unfinished if not p.stall_checked]
            self._stall_watch = self._watcher.at(min(later) + stall, self._stall_sweep) if later else None
        for pending in due:
            self._stall_check(pending)

    def _stall_check(self, pending: Pending) -> None:
        """Past the stall threshold and not finished: warn once, naming who is missing."""
        for waiting in self.waiting():
            if waiting.sequence != pending.sequence or waiting.stage == RUNNING:
                continue
            pending.stalled = True
            nodes = (
                f"; node(s) {', '.join(map(str, waiting.missing_nodes))} not heard from"
                if waiting.missing_nodes
                else ""
            )
            log.warning(
                f"collective #{pending.sequence} ({pending.spec.op}) of job {self.name!r} has "
                f"waited {waiting.seconds:.1f} s ({waiting.stage}): "
                f"{self._whereabouts(waiting.missing_ranks)}{nodes}",
                extra={
                    "job": self.name,
                    "sequence": pending.sequence,
                    "missing_ranks": list(waiting.missing_ranks),
                    "missing_nodes": list(waiting.missing_nodes),
                },
            )

    def _whereabouts(self, missing: Sequence[int]) -> str:
        """'missing rank(s) 1; rank(s) 2, 3 attached to node 1': a rank another node serves
        is attached there (its node is the one not heard from), not missing."""
        layout = self.layout
        here: list[int] = []
        elsewhere: dict[int, list[int]] = {}
        for r in missing:
            if layout is not None and layout.node_of[r] != layout.node:
                elsewhere.setdefault(layout.daemon(layout.node_of[r]), []).append(r)
            else:
                here.append(r)
        parts = [f"missing rank(s) {', '.join(map(str, here)) or '-'}"] if here or not elsewhere else []
        parts += [
            f"rank(s) {', '.join(map(str, rs))} attached to node {d}" for d, rs in sorted(elsewhere.items())
        ]
        return "; ".join(parts)

    def waiting(self) -> list[Waiting]:
        """What this job's unfinished collectives wait for, oldest first."""
        now, stall = time.monotonic(), self.recorder.stall_seconds
        with self.lock:
            pendings = [*self._pending.values(), *self._active.values()]
        out = []
        for p in sorted(pendings, key=lambda p: p.sequence):
            arrived = tuple(sorted(p.arrivals))
            missing_nodes = p.waiting_nodes if p.stage == AGREEING else ()
            if p.stage == ARRIVING:
                missing = tuple(r for r in self.local_ranks if r not in p.arrivals)
            elif missing_nodes and self.layout is not None:
                missing = tuple(sorted(r for n in missing_nodes for r in self.layout.ranks_of(n)))
            else:
                missing = ()
            out.append(
                Waiting(
                    p.sequence,
                    p.spec.op,
                    p.stage,
                    p.opened_wall,
                    now - p.opened,
                    arrived,
                    missing,
                    # As daemons of --peers (a job on daemons 2 and 5 numbers them 0, 1).
                    tuple(self.layout.daemon(n) for n in missing_nodes) if self.layout else missing_nodes,
                    p.stalled or now - p.opened >= stall,
                )
            )
        return out

    def _finish(self, pending: Pending, outcome: Outcome, now: float | None = None) -> None:
        """Keep ``pending``'s record in the flight recorder; ``now``: when it finished
        (taken before the replies, which may wait on a loaded machine)."""
        now = time.monotonic() if now is None else now
        pending.enter("", now)
        error = outcome.error
        record = FlightRecord(
            pending.sequence,
            pending.spec,
            pending.opened_wall,
            _arrived(pending),
            tuple(pending.stages),
            now - pending.opened,
            outcome.algorithm,
            outcome.chunks,
            "OK" if error is None else error.code,
            "" if error is None else str(error),
        )
        with self.lock:
            self._active.pop(pending.sequence, None)
            self._record_in_order(record)
            if error is None:
                self.last_progress = time.time()

    def _check(self, pending: Pending) -> MismatchError | None:
        ranks = sorted(pending.arrivals)
        specs = {r: pending.arrivals[r].spec for r in ranks}
        first = specs[ranks[0]]
        fields = sorted({f for r in ranks for f in first.differences(specs[r])})
        if not fields:
            return None
        detail = "; ".join(
            f"{f}: " + ", ".join(f"rank {r}={getattr(specs[r], f)!r}" for r in ranks) for f in fields
        )
        return MismatchError(
            f"collective #{pending.sequence} of job {self.name!r}: participants disagree on "
            f"{', '.join(fields)} ({detail})"
        )

    def _expire(self, pending: Pending) -> None:
        with self.lock:
            if self._pending.get(pending.sequence) is not pending:
                return  # completed or failed meanwhile
            del self._pending[pending.sequence]
            missing = sorted(set(self.local_ranks) - set(pending.arrivals))
            first = min(pending.arrivals.values(), key=lambda a: a.timeout)
            error = CollectiveTimeoutError(
                f"collective #{pending.sequence} ({pending.spec.op}) of job {self.name!r}: "
                f"rank(s) {', '.join(map(str, missing))} did not arrive within "
                f"{first.timeout:g} s (arrived: {', '.join(map(str, sorted(pending.arrivals)))})"
            )
            self._remember(pending.sequence, error)
        self._fail(pending, error)

    def _remember(self, sequence: int, error: LpsyncError) -> None:
        self._failed[sequence] = error
        while len(self._failed) > _REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def _fail(self, pending: Pending, error: LpsyncError) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
        self._runner.failed_here(self, pending, error)  # no lock held
        outcome = Outcome(error)
        self._finish(pending, outcome)
        self._runner.finished(self, pending, outcome)
        for arrival in pending.arrivals.values():
            arrival.done(Outcome(error, INTACT if arrival.in_place else UNSPECIFIED))

    def outstanding(self) -> int:
        """Collectives arriving, queued or running (a racy read: for metrics)."""
        return len(self._pending) + len(self._active)

    def run_now(self, pending: Pending) -> bool:
        """Run ``pending`` on this thread if it is next and no collective of this job is
        running, without waiting (True); else leave it to its dispatched run (False)."""
        if not self._run_lock.acquire(blocking=False):
            return False
        with self.lock:
            next_up = bool(self._queued) and self._queued[0][1] is pending
        if not next_up:
            self._run_lock.release()
            return False
        self._run_next(held=True)
        return True

    def _run_next(self, held: bool = False) -> None:
        """Run the lowest queued collective: the one dispatched may be a later one, which
        a later run takes (there is one run per queued collective). ``held``: the caller
        took the run lock."""
        if not held:
            self._run_lock.acquire()
        try:
            with self.lock:
                _, pending = heapq.heappop(self._queued)
            # A multi-node collective first agrees with the other nodes (path.py).
            pending.enter(RUNNING if self.layout is None else AGREEING)
        except BaseException:  # a bug: the job's later collectives must still run
            self._run_lock.release()
            raise
        try:
            outcome = self._runner.run(self, pending)
        except LpsyncError as error:
            outcome = Outcome(error)
        except Exception as error:  # a bug: report it rather than hang the participants
            log.exception("collective failed unexpectedly")
            outcome = Outcome(LpsyncError(f"internal error: {error!r}"))
        if isinstance(outcome, Later):
            outcome.then(functools.partial(self._ran, pending))
        else:
            self._ran(pending, outcome)

    def _ran(self, pending: Pending, outcome: Outcome) -> None:
        """``pending`` finished: let the next collective run, then reply and record."""
        self._run_lock.release()
        finished = time.monotonic()
        for arrival in pending.arrivals.values():
            if outcome.error is None:
                arrival.done(outcome)  # the same for each: read, never changed
                continue
            state = PARTIAL if arrival.in_place else UNSPECIFIED
            arrival.done(Outcome(outcome.error, state, outcome.algorithm, outcome.chunks, outcome.seconds))
        # After the replies: off the critical path.
        self._finish(pending, outcome, finished)
        self._runner.finished(self, pending, outcome)


def _arrived(pending: Pending) -> tuple[tuple[int, float], ...]:
    """(rank, seconds after the first arrival) of each participant, in rank order (a loop,
    not a generator: this runs for every collective)."""
    opened, arrivals = pending.opened, pending.arrivals
    out = []
    for rank in sorted(arrivals):
        out.append((rank, arrivals[rank].at - opened))
    return tuple(out)


@dataclass(frozen=True)
class Recorder:
    """Flight-recorder settings shared by every job of a daemon."""

    size: int = 32  # finished collectives kept per job (--flight-recorder)
    stall_seconds: float = 60.0  # warn when a collective waits this long (--stall-seconds)


class Jobs:
    """Every job of this daemon by name; a job disappears with its last rank."""

    def __init__(
        self,
        watcher: Watcher,
        runner: JobRunner,
        recorder: Recorder | None = None,
        max_pending: int = 4096,
        native: bool = False,
    ) -> None:
        self.max_pending = max_pending
        self._native = native  # its jobs may run natively (Job.native_plans)
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._watcher, self._runner = watcher, runner
        self._recorder = recorder or Recorder()

    def join(
        self, name: str, rank: int, world_size: int, session_id: str, layout: NodeLayout | None = None
    ) -> Job:
        with self._lock:
            job = self._jobs.get(name)
            if job is None:
                job = self._jobs[name] = Job(
                    name,
                    world_size,
                    self._watcher,
                    self._runner,
                    layout,
                    self._recorder,
                    self.max_pending,
                    self._native,
                )
            elif job.layout != layout:
                raise InvalidArgumentError(_other_layout(job, rank, layout))
            try:
                job.join(rank, world_size, session_id)
            except LpsyncError:
                if not job.sessions:  # created for this attach: leave nothing behind
                    del self._jobs[name]
                raise
            return job

    def leave(self, name: str, rank: int, reason: str) -> None:
        with self._lock:
            job = self._jobs.get(name)
        if job is not None and job.leave(rank, reason):
            with self._lock:
                if self._jobs.get(name) is job and not job.sessions:
                    del self._jobs[name]
                    job.close()

    def get(self, name: str) -> Job | None:
        with self._lock:
            return self._jobs.get(name)

    def all(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())


def _other_layout(job: Job, rank: int, layout: NodeLayout | None) -> str:
    """Why ``rank`` cannot join ``job``: it brought another layout than the job's ranks on
    this node (they discovered, or claimed, different ones)."""

    def text(lay: NodeLayout | None) -> str:
        said = "one node (no layout)" if lay is None else lay.describe()
        return said if len(said) <= 400 else said[:400] + "…"

    others = ranks_text(sorted(job.sessions)) if job.sessions else "its earlier ranks"
    return (
        f"job {job.name!r}: rank {rank} attached with another node layout than {others} on "
        f"this node: rank {rank} says {text(layout)}; {others} said {text(job.layout)}"
    )
