"""The collective runner: the one object every Job hands its complete collectives to
(matching.JobRunner). It decides where each runs (inline on the event loop, or on one of
its worker threads), runs it (path.py), keeps what is kept of each outcome (the metrics,
the recent list and multi-node outcomes that Status shows, a pair job's inbox), tells
a multi-node job's other nodes of a collective that failed here before it ran, and makes
a job's armed plans (lpsync/native) when it first arms one. It counts the collectives
running, so that a shutdown can drain them.

Nothing here knows the control layer: the metrics come in as a ``Tally`` (what
control/metrics.py's Metrics offers), the rest are collectives' own parts.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from lpsync import native
from lpsync.daemon.collectives import path
from lpsync.daemon.collectives.inbox import Inbox
from lpsync.daemon.collectives.local import is_inline
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.outcomes import Outcomes
from lpsync.daemon.collectives.views import facts
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.plane import PeerPlane
from lpsync.daemon.values import Later, Outcome, Pending
from lpsync.errors import LpsyncError
from lpsync.memory.kind import Span
from lpsync.native.armed import ArmedPlans
from lpsync_client.wire.pairs import parse_pair

log = logging.getLogger("lpsync.daemon")

RECENT = 256  # finished collectives the recent list keeps (Status)
# The recent list's entries, in this order; made into messages only when Status asks,
# to keep the collective path short.
RECORD_FIELDS = ("job", "sequence", "op", "dtype", "count", "algorithm", "seconds", "code", "finished_at")


class Tally(Protocol):
    """Where finished collectives are counted (control/metrics.py's Metrics)."""

    def collective_done(
        self, op: str, algorithm: str, dtype: str, nbytes: int, seconds: float, factor: float
    ) -> None: ...

    def collective_failed(self, op: str, code: str) -> None: ...

    def collectives_done(
        self, op: str, algorithm: str, dtype: str, nbytes: int, counts: list[int], total: float, factor: float
    ) -> None: ...


@functools.lru_cache(maxsize=1024)
def pair_of(job: str) -> tuple[str, int, int, int] | None:
    """parse_pair, once per name: every collective of every job asks (twice)."""
    return parse_pair(job)


class Conductor:
    def __init__(
        self,
        workers: int,
        tally: Tally,
        inbox: Inbox,
        plane: PeerPlane | None = None,
        devices: DeviceRegistry | None = None,
        outcomes: Outcomes | None = None,
        buckets: tuple[float, ...] = (),
    ) -> None:
        self._tally, self._inbox, self._plane, self._devices = tally, inbox, plane, devices
        self._buckets = buckets  # the engines' histogram bounds: the tally's
        self.outcomes = outcomes  # multi-node: this node's outcomes across nodes (Status)
        # (job, seq, op, dtype, count, algorithm, seconds, code, unix time): RECORD_FIELDS.
        self.recent: deque[tuple] = deque(maxlen=RECENT)
        # Pipelined collectives run on these threads so that the event loop stays free.
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lpsync-run")
        self._loop_thread = -1  # the event loop's thread (on_loop); -1: none yet
        self._closing = False
        self._running = 0  # collectives running now, under _counting
        self._counting = threading.Lock()
        self._idle = threading.Condition()  # notified as each one ends, once closing

    def on_loop(self, thread: int) -> None:
        """The event loop's thread, where only short collectives run inline."""
        self._loop_thread = thread

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on a worker thread."""
        return self.pool.submit(fn, *args)

    # -- matching.JobRunner --------------------------------------------------------------------
    def dispatch(self, job: Job, pending: Pending, run: Callable[[], None]) -> None:
        """Where a complete collective runs: the direct path inline (it is short), anything
        else off the event loop, on a worker thread, so other sessions keep being served."""
        if threading.get_ident() != self._loop_thread:
            run()
            return
        # On the loop only what is short and never waits: a small single-node host
        # collective whose job is not running another one and has no earlier one queued
        # (a multi-node one waits on other nodes, a device one on streams).
        if (
            job.layout is None
            and is_inline(pending.spec, job.world_size)
            and not _on_device(pending)
            and job.run_now(pending)
        ):
            return
        self.pool.submit(run)

    def run(self, job: Job, pending: Pending) -> Outcome | Later[Outcome]:
        with self._counting:
            self._running += 1
        try:
            return path.run(job, pending, self._plane, self._devices)
        finally:
            with self._counting:
                self._running -= 1
            self.wake()

    def finished(self, job: Job, pending: Pending, outcome: Outcome) -> None:
        spec = pending.spec
        code = "OK" if outcome.error is None else outcome.error.code
        self._received(job, pending)
        if job.layout is not None and self.outcomes is not None:
            self.outcomes.ran(job.name, pending.sequence, job.layout.daemons, code)
        self.recent.append(
            (
                job.name,
                pending.sequence,
                spec.op,
                spec.dtype,
                spec.count,
                outcome.algorithm,
                outcome.seconds,
                code,
                time.time(),
            )
        )
        if outcome.error is not None:
            self._tally.collective_failed(spec.op, code)
            # Failures are rare and worth a line; successes only go to metrics and Status.
            log.info(
                "collective failed",
                extra={
                    "job": job.name,
                    "sequence": pending.sequence,
                    "op": spec.op,
                    "code": code,
                    "error": str(outcome.error),
                },
            )
            return
        _, _, nbytes, bus = facts(spec, job.world_size)
        self._tally.collective_done(spec.op, outcome.algorithm, spec.dtype, nbytes, outcome.seconds, bus)

    def failed_here(self, job: Job, pending: Pending, error: LpsyncError) -> None:
        """A multi-node job's other nodes hear of it (path.notify_failure), on a worker
        thread: it takes this node's part in the agreement, which waits for theirs."""
        if job.layout is not None and self._plane is not None:
            if job.native is not None:
                # Armed peers wait in the GO round: they fall back to hear it. Said before
                # this node's ranks are answered: a rank that detaches then may end the
                # job, closing its channels, and the peers would hear a lost channel.
                job.native.notice(pending.sequence, job.layout.node)
            self.pool.submit(path.notify_failure, job, pending, error, self._plane)

    def native_plans(self, job: Job) -> ArmedPlans | None:
        """A job's armed plans (its doorbell page and engine thread), made at its first plan
        armed; None where it cannot have them (its slots, a failure)."""
        module = native.engine()
        if module is None or job.world_size > module.MAX_SLOTS:
            return None
        try:
            local = tuple(job.local_ranks) if job.layout is not None else None
            plans = ArmedPlans(job.world_size, self._buckets, self._tally.collectives_done, local)
        except (OSError, LpsyncError, ValueError) as error:
            log.warning("job runs on the Python path: " + str(error), extra={"job": job.name})
            return None
        log.info("job's repeated collectives run natively", extra={"job": job.name, "page": plans.page.name})
        return plans

    # -- what the engines ran --------------------------------------------------------------------
    def native_finished(self, jobs: Iterable[Job]) -> None:
        """What the engines answered joins the flight recorders and the recent list (at a
        scrape and at ``lpsync status``: never per call)."""
        for job in jobs:
            for r in job.native_finished():
                finished = r.started_at + r.seconds
                self.recent.append(
                    (
                        job.name,
                        r.sequence,
                        r.spec.op,
                        r.spec.dtype,
                        r.spec.count,
                        r.algorithm,
                        r.seconds,
                        r.code,
                        finished,
                    )
                )

    # -- shutdown ----------------------------------------------------------------------------------
    def drain(self, deadline: float, attached: Callable[[], bool]) -> None:
        """Close, then wait (up to ``deadline``, monotonic) for the collectives running now
        while ``attached()`` (someone is there to take their results)."""
        self._closing = True
        with self._idle:
            while self._running and attached() and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)

    def wake(self) -> None:
        """Something drain waits on changed (a collective ended, a session went)."""
        if self._closing:  # drain() set it before it reads _running: no lost wake-up
            with self._idle:
                self._idle.notify_all()

    def stop(self) -> None:
        self.pool.shutdown(wait=False)

    def _received(self, job: Job, pending: Pending) -> None:
        """A pair job's message received here (or failed) leaves the inbox."""
        pair = pair_of(job.name)
        if pair is None:
            return
        layout = job.layout
        if layout is not None and layout.node_of[1] != layout.node:
            return  # the sender's side
        parent, source, destination, tag = pair
        self._inbox.finished((parent, destination, tag), source, pending.sequence)


def _on_device(pending: Pending) -> bool:
    """Device collectives wait on streams: never inline on the event loop."""
    return any(isinstance(a.data, Span) for a in pending.arrivals.values())
