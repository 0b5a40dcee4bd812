"""The daemon's parts and their life: built once (sessions, jobs, the collective runner,
placing, the devices), a session ended, a collective handed to its job (or held by
placing until its layout settles), and the shutdown. The servicer (handlers.py), the
trigger socket (trigger.py), admission (admission.py) and Status (status.py) work on
these parts; server.py builds one DaemonState and serves it.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
import time

from lpsync import native
from lpsync.daemon.collectives.conductor import Conductor
from lpsync.daemon.collectives.matching import Job, Jobs, Recorder
from lpsync.daemon.collectives.outcomes import Outcomes
from lpsync.daemon.control.any_source import AnySource
from lpsync.daemon.control.config import DaemonConfig
from lpsync.daemon.control.metrics import BUCKETS, JobState, Metrics
from lpsync.daemon.control.placing import Placing
from lpsync.daemon.control.sessions import Session, SessionTable
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.attached import Attached
from lpsync.daemon.peers.plane import PeerPlane
from lpsync.daemon.values import Arrival, Outcome
from lpsync.daemon.watcher import Watcher
from lpsync.errors import LpsyncError, NotFoundError, UnavailableError
from lpsync.memory.devices import open_kind, parse_devices
from lpsync_client.wire.proto import lpsync_pb2 as pb

log = logging.getLogger("lpsync.daemon")


class DaemonState:
    def __init__(self, config: DaemonConfig, metrics: Metrics, plane: PeerPlane | None = None) -> None:
        self.config, self.metrics = config, metrics
        self.plane = plane  # the peer manager; None: a single-node daemon
        # Which node this is, for the ranks that discover their job's layout (layout.py).
        self.node_info = describe_node(plane)
        # Multi-node: this node's outcomes of cross-node collectives and what the other
        # nodes told of theirs on each new mesh (outcomes.py), for Status.
        self.outcomes = Outcomes(plane.rank) if plane is not None else None
        if plane is not None:
            plane.exchange = self.outcomes
        self.started = time.time()
        kind = open_kind(parse_devices(config.devices))
        self.devices = DeviceRegistry(kind, config.device_staging_bytes) if kind is not None else None
        self.limits = config.limits()
        self.sessions = SessionTable(self.limits, on_bytes=self._bytes_changed, devices=self.devices)
        if self.devices is not None:
            metrics.describe_devices(self.devices.kind.name, self.devices.kind.devices)
        self.watcher = Watcher()
        # Receive from any source: the sends announced to this daemon's receivers.
        self.any_source = AnySource(self.watcher, plane, self.limits.max_pending)
        # Where the jobs' complete collectives run, and what is kept of each (conductor.py).
        self.conductor = Conductor(
            config.workers, metrics, self.any_source.inbox, plane, self.devices, self.outcomes, BUCKETS
        )
        self.jobs = Jobs(
            self.watcher,
            self.conductor,
            Recorder(config.flight_recorder, config.stall_seconds),
            max_pending=self.limits.max_pending,
            native=config.native != "off" and native.engine() is not None,
        )
        # The engine's counts join the metrics at each scrape (never per call).
        metrics.before_collect(lambda: self.conductor.native_finished(self.jobs.all()))
        if plane is not None:  # a lost mesh stops armed runs across nodes (their engines
            plane.on_lost = self._peers_lost  # do not hear the heartbeats)
        # Multi-node: where every job's ranks attached, as the daemons tell each other, and
        # its first collectives held until that settles its layout (placing.py).
        self.placing = (
            Placing(
                Attached(plane),
                self.watcher,
                self._release,
                self._placed,
                self.jobs.get,
                on_failure=metrics.collective_failed,
            )
            if plane is not None
            else None
        )
        metrics.session_bytes_limit.set(config.max_session_bytes)
        metrics.buffer_bytes_limit.set(config.max_buffer_bytes)
        metrics.watch(
            lambda: [JobState(j.name, j.outstanding(), j.last_progress) for j in self.jobs.all()],
            lambda: [s.nbytes for s in self.sessions.all()],
        )
        self._closing = False
        self._ending = threading.Lock()
        self.trigger_path = ""  # set by the server when it offers the trigger socket
        # The peer plane's transport and device path, chosen at start (server.py); empty
        # on a single node.
        self.peer_plane = pb.PeerPlaneInfo()

    def _peers_lost(self) -> None:
        for job in self.jobs.all():
            if job.native is not None:
                job.native.abort_net()

    def _bytes_changed(self, total: int) -> None:
        self.metrics.registered_bytes.set(total)
        if self.devices is not None:
            self.metrics.device_bytes(self.devices.registered)

    # -- lifecycle -------------------------------------------------------------------------
    def end_session(self, session: Session, reason: str, wait: bool = False) -> None:
        """Idempotent: abort what waits on the session, free its buffers, end its stream.
        Device mappings close on the registry's thread unless ``wait`` (a Detach: its
        client frees the memory once answered, so they must be closed by then)."""
        with self._ending:
            if session.ended:
                return
            session.ended = True
        # Abort first, so the other ranks hear of it; then free the buffers.
        self.jobs.leave(session.job, session.rank, reason)
        if self.placing is not None:
            self.placing.left(session.job, session.rank, reason)
        buffers = self.sessions.remove(session, wait)
        job = self.jobs.get(session.job)
        if job is not None:
            for buffer in buffers:
                job.plans.forget(session.id, buffer.handle)
        for callback in session.on_close:
            callback()
        self.metrics.sessions.set(len(self.sessions.all()))
        self.conductor.wake()  # shutdown() drains only while some session is attached
        log.info(
            "session ended",
            extra={
                "session": session.id,
                "job": session.job,
                "rank": session.rank,
                "reason": reason,
                "buffers_freed": len(buffers),
            },
        )

    def shutdown(self, drain: float) -> None:
        """Refuse new work, let running collectives finish (up to ``drain`` s) while a
        session is attached to take their results, end all. A collective whose ranks are
        all gone (a trainer killed inside a call) has no one to answer, and across nodes
        it waits for nodes that are draining too: waiting for it would hold every exit."""
        self._closing = True
        self.conductor.drain(time.monotonic() + drain, lambda: bool(self.sessions.all()))
        for session in self.sessions.all():
            self.end_session(session, "daemon shutting down")
        self.sessions.close_all()
        if self.devices is not None:
            self.devices.close()
        self.watcher.stop()
        self.conductor.stop()

    def check_open(self) -> None:
        if self._closing:
            raise UnavailableError("the daemon is shutting down")

    def release_buffer(self, session: Session, handle: int) -> None:
        """Release a buffer: its armed plans are disarmed before it is unmapped."""
        job = self.jobs.get(session.job)
        if job is not None and job.native is not None:
            job.native.forget(session.id, handle)
        self.sessions.release(session, handle)

    # -- where a collective goes -------------------------------------------------------------
    def _placed(self, job: Job) -> None:
        """``job``'s layout settled (placing.py), before its first collective goes on."""
        for session in self.sessions.all():
            if session.job == job.name:
                session.multinode = job.layout is not None

    def _release(self, session: Session, arrival: Arrival) -> None:
        """A collective that waited for its job's layout goes on (placing.py), on a worker
        thread: the thread that settled the layout may be a peer's note reader, which a
        collective run on it would hold from the notes it waits for."""
        self.conductor.submit(self._resubmit, session, arrival)

    def _resubmit(self, session: Session, arrival: Arrival) -> None:
        try:
            self.submit(session, arrival, announced=True)
        except LpsyncError as error:
            self.metrics.collective_failed(arrival.spec.op, error.code)
            arrival.done(Outcome(error))

    def submit(self, session: Session, arrival: Arrival, announced: bool = False) -> None:
        """``announced``: a collective released by placing.py, announced when it came."""
        if self._closing:  # check_open, inline: this runs for every request
            self.check_open()
        job = self.jobs.get(session.job)
        if job is None or session.closed:
            raise NotFoundError(f"session {session.id} has ended")
        # Announced first: submit may run the collective on this thread, which waits for
        # the receiver, which waits for the announcement (and so does a receiver's attach,
        # which the layout of a send held by placing waits for).
        if not announced:
            self.any_source.sent(job, session.rank, arrival)
        try:
            if self.placing is not None and self.placing.holds(job, session, arrival):
                # It goes on once the job's layout is settled. Without a mesh no daemon can
                # learn where ranks elsewhere are: if it is still down a heartbeat timeout
                # from now, UNAVAILABLE, as a settled job's collective gets (a job whose
                # ranks all come here settles meanwhile: the survivors keep serving).
                assert self.plane is not None  # placing exists with peers only
                if self.plane.down() is not None:
                    self.watcher.at(
                        time.monotonic() + self.config.heartbeat_timeout, lambda: self._unplaceable(job)
                    )
                return
            job.submit(arrival)
        except LpsyncError:
            self.any_source.refused(job, session.rank, arrival)
            raise

    def _unplaceable(self, job: Job) -> None:
        """A heartbeat timeout after a collective of ``job`` was held with the mesh down:
        if it is still down, what the job holds fails UNAVAILABLE."""
        assert self.plane is not None and self.placing is not None
        lost = self.plane.down()
        if lost is not None:
            self.placing.fail_open(
                job.name,
                UnavailableError(
                    f"node {self.plane.rank}: the peer mesh is down and rebuilding (lost: {lost}); "
                    f"job {job.name!r}'s layout cannot be settled without it"
                ),
            )


def describe_node(plane: PeerPlane | None) -> pb.NodeInfo:
    """This daemon as the Node RPC and Attach describe it. The cluster identity is the
    --peers list (node-rank order, the same on every daemon of a cluster); a daemon without
    peers is a cluster of its own: its host and a token drawn at start."""
    if plane is None:
        return pb.NodeInfo(node_rank=0, nodes=1, cluster=f"{socket.gethostname()}/{secrets.token_hex(4)}")
    peers = ",".join(str(p) for p in plane.options.peers.peers)
    digest = hashlib.sha256(peers.encode()).hexdigest()[:12]
    return pb.NodeInfo(node_rank=plane.rank, nodes=plane.size, cluster=f"peers-{digest}")
