"""Receive from any source, the daemon's side: announce the sends of pair jobs to the
receiver's daemon and answer Probes from the inbox (collectives/inbox.py); a message
leaves it once its pair collective finished here (collectives/conductor.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lpsync.daemon.collectives import inbox
from lpsync.daemon.collectives.conductor import pair_of
from lpsync.daemon.collectives.inbox import Inbox
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.control.sessions import Session
from lpsync.daemon.peers.plane import PeerPlane
from lpsync.daemon.values import Arrival
from lpsync.daemon.watcher import Watcher
from lpsync.errors import InvalidArgumentError, LpsyncError
from lpsync_client.wire.pairs import MAX_TAG
from lpsync_client.wire.proto import lpsync_pb2 as pb

log = logging.getLogger("lpsync.daemon")

Reply = Callable[[pb.SessionResponse], None]
Fail = Callable[[LpsyncError], None]


class AnySource:
    def __init__(self, watcher: Watcher, plane: PeerPlane | None, max_messages: int) -> None:
        self.inbox = Inbox(watcher, max_messages)
        self._plane = plane
        if plane is not None:
            plane.on_note = self._noted

    def sent(self, job: Job, rank: int, arrival: Arrival) -> None:
        """``rank`` of ``job`` issued ``arrival``: if it is the sender of a pair job,
        announce it to the receiver's daemon."""
        pair = pair_of(job.name)
        if pair is None or rank != 0:
            return
        parent, source, destination, tag = pair
        key = (parent, destination, tag)
        receiver = _receiver_daemon(job)
        if receiver is None or (self._plane is not None and receiver == self._plane.rank):
            self.inbox.announce(key, source, arrival.sequence, arrival.timeout)
        elif self._plane is not None:
            try:
                self._plane.note(receiver, inbox.note(key, source, arrival.sequence, arrival.timeout))
            except ValueError as error:  # a job name beyond the note's size
                log.warning("could not announce a send of job %r: %s", job.name, error)

    def refused(self, job: Job, rank: int, arrival: Arrival) -> None:
        """The send ``sent`` announced was refused (its job full, its session ended): off
        the inbox where the receiver is here; across nodes its receiver's probe may still
        name it, and that receive then fails at its timeout, like the send did at once."""
        pair = pair_of(job.name)
        if pair is None or rank != 0:
            return
        receiver = _receiver_daemon(job)
        if receiver is None or (self._plane is not None and receiver == self._plane.rank):
            parent, source, destination, tag = pair
            self.inbox.finished((parent, destination, tag), source, arrival.sequence)

    def probe(self, session: Session, timeout: float, probe: pb.Probe, reply: Reply, fail: Fail) -> None:
        """Answer ``probe`` from ``session`` (the receiver) once a message is there."""
        if probe.tag >= MAX_TAG:
            raise InvalidArgumentError(f"probe: tag {probe.tag} is outside 0..{MAX_TAG - 1}")
        if len(probe.sources) != len(probe.issued) or len(probe.sources) > session.world_size:
            raise InvalidArgumentError(
                f"probe: {len(probe.sources)} sources and {len(probe.issued)} counts for a job of "
                f"{session.world_size} ranks"
            )
        if any(s >= session.world_size for s in probe.sources):
            raise InvalidArgumentError(f"probe: a source beyond the job's {session.world_size} ranks")

        def found(source: int, sequence: int) -> None:
            reply(pb.SessionResponse(probed=pb.Probed(source=source, sequence=sequence)))

        key = (session.job, session.rank, probe.tag)
        issued = dict(zip(probe.sources, probe.issued, strict=True))
        self.inbox.probe(key, issued, time.monotonic() + timeout, found, fail)

    def _noted(self, peer: int, data: bytes) -> None:
        try:
            key, source, sequence, timeout = inbox.read_note(data)
        except ValueError as error:
            log.warning("an unreadable note from node %d ignored: %s", peer, error)
            return
        self.inbox.announce(key, source, sequence, timeout)


def _receiver_daemon(job: Job) -> int | None:
    """The daemon of a pair job's receiver (its rank 1); None for a job on one node."""
    layout = job.layout
    return None if layout is None else layout.daemon(layout.node_of[1])
