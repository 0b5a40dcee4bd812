"""Which ranks of each job every daemon of the cluster serves, as each one tells.

Each daemon tells every peer, over the peer plane (ATTACHED notes, in order per peer),
the ranks of each job that attach to it, that leave it, and that it refused (with why).
On every new mesh it first tells each peer to forget what it said before, then says
again all it serves now: a peer that restarted, or notes lost with a broken mesh, are
set right there. From that every daemon knows where each rank of a job attached
(control/placing.py settles a job's layout from it and judges contradictions).

A note is JSON of at most NOTE_BYTES: {"reset": 1}, or {"job", "world", "add": runs},
{"job", "drop": runs}, {"job", "world", "refused": rank, "why": text}; runs are
[first, last] pairs of consecutive ranks, at most _RUNS to a note.
Lock order: Attached._lock, then the plane's (note() takes it); listeners run with no
lock held.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from lpsync.daemon.peers.plane import NOTE_BYTES, PeerPlane
from lpsync.transport.tags import ATTACHED

log = logging.getLogger("lpsync.peers")

_RUNS = 64  # rank runs per note: with a job name of MAX_JOB_BYTES, well under NOTE_BYTES
MAX_JOB_BYTES = 2048  # the longest job name a note carries (UTF-8 bytes)
_REFUSALS = 256  # refused attaches remembered (of ranks not attached since), oldest dropped
# Seconds a refusal is remembered: what waits for that rank hears of it meanwhile (and
# then waits for it no longer than placing.BOUND); a later run of a job of the same name
# is not failed by it.
REFUSAL_SECONDS = 30.0
_WHY = 600  # characters of a refusal's reason told


@dataclass
class JobSeen:
    """One job as the cluster's daemons told it (a snapshot: the caller's own)."""

    sizes: dict[int, int] = field(default_factory=dict)  # daemon -> world size it was told
    nodes_of: dict[int, set[int]] = field(default_factory=dict)  # rank -> daemons it attached to
    refused: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (daemon, why)


class Attached:
    """This daemon's ranks by job, and what every peer said of its own."""

    def __init__(self, plane: PeerPlane) -> None:
        self.node = plane.rank
        self._plane = plane
        self._lock = threading.Lock()
        # daemon -> job -> (world size, ranks); this daemon's own entry included.
        self._serves: dict[int, dict[str, tuple[int, set[int]]]] = {plane.rank: {}}
        # (job, rank) -> (daemon, world size, why, monotonic time heard): attaches refused,
        # until that rank attaches or REFUSAL_SECONDS pass.
        self._refused: OrderedDict[tuple[str, int], tuple[int, int, str, float]] = OrderedDict()
        self._listeners: list[Callable[[str], None]] = []
        plane.on_attached = self._heard
        plane.on_mesh = self._retell

    def listen(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(job)`` (any thread, no lock held) whenever what is known of
        ``job`` changes."""
        self._listeners.append(listener)

    # -- this daemon's ranks -------------------------------------------------------------------
    def attached(self, job: str, world_size: int, rank: int) -> None:
        with self._lock:
            self._add(self.node, job, world_size, [rank])
            self._tell_all([{"job": job, "world": world_size, "add": [[rank, rank]]}])
        self._changed(job)

    def left(self, job: str, rank: int) -> None:
        with self._lock:
            self._drop(self.node, job, [rank])
            self._tell_all([{"job": job, "drop": [[rank, rank]]}])
        self._changed(job)

    def refused(self, job: str, world_size: int, rank: int, why: str) -> None:
        """``rank``'s attach to this daemon was refused: the job's other ranks, wherever
        they are, hear it at once (and why) instead of waiting for it."""
        why = why[:_WHY]
        with self._lock:
            self._refuse(self.node, job, world_size, rank, why)
            self._tell_all([{"job": job, "world": world_size, "refused": rank, "why": why}])
        self._changed(job)

    # -- what is known -------------------------------------------------------------------------
    def seen(self, job: str) -> JobSeen:
        out = JobSeen()
        with self._lock:
            for daemon, jobs in self._serves.items():
                entry = jobs.get(job)
                if entry is None:
                    continue
                out.sizes[daemon] = entry[0]
                for rank in entry[1]:
                    out.nodes_of.setdefault(rank, set()).add(daemon)
            recent = time.monotonic() - REFUSAL_SECONDS
            for (name, rank), (daemon, world, why, heard) in self._refused.items():
                if name == job and heard >= recent:
                    out.refused[rank] = (daemon, why)
                    out.sizes.setdefault(daemon, world)
        return out

    # -- the peer plane's side -----------------------------------------------------------------
    def _retell(self) -> None:
        """A new mesh is up: each peer forgets what this node said, then hears it anew."""
        with self._lock:
            notes: list[dict] = [{"reset": 1}]
            for job, (world, ranks) in self._serves[self.node].items():
                notes += [{"job": job, "world": world, "add": runs} for runs in _batches(ranks)]
            recent = time.monotonic() - REFUSAL_SECONDS
            for (job, rank), (daemon, world, why, heard) in self._refused.items():
                if daemon == self.node and heard >= recent:
                    notes.append({"job": job, "world": world, "refused": rank, "why": why})
            self._tell_all(notes)

    def _heard(self, peer: int, data: bytes) -> None:
        note = json.loads(data)
        if note.get("reset"):
            with self._lock:
                jobs = set(self._serves.pop(peer, {}))
                for key in [k for k, v in self._refused.items() if v[0] == peer]:
                    jobs.add(key[0])
                    del self._refused[key]
            for job in jobs:
                self._changed(job)
            return
        job = str(note["job"])
        with self._lock:
            if "add" in note:
                world = int(note["world"])
                self._add(peer, job, world, _ranks(note["add"], world))
            elif "drop" in note:
                world = self._serves.get(peer, {}).get(job, (0, set()))[0]
                self._drop(peer, job, _ranks(note["drop"], world))
            elif "refused" in note:
                self._refuse(peer, job, int(note["world"]), int(note["refused"]), str(note["why"]))
        self._changed(job)

    # -- under the lock ------------------------------------------------------------------------
    def _add(self, daemon: int, job: str, world_size: int, ranks: Iterable[int]) -> None:
        jobs = self._serves.setdefault(daemon, {})
        _, mine = jobs.setdefault(job, (world_size, set()))
        jobs[job] = (world_size, mine)
        for rank in ranks:
            mine.add(rank)
            self._refused.pop((job, rank), None)  # attached since: no longer refused

    def _drop(self, daemon: int, job: str, ranks: Iterable[int]) -> None:
        jobs = self._serves.get(daemon, {})
        entry = jobs.get(job)
        if entry is None:
            return
        entry[1].difference_update(ranks)
        if not entry[1]:
            del jobs[job]

    def _refuse(self, daemon: int, job: str, world_size: int, rank: int, why: str) -> None:
        self._refused[job, rank] = (daemon, world_size, why, time.monotonic())
        self._refused.move_to_end((job, rank))
        while len(self._refused) > _REFUSALS:
            self._refused.popitem(last=False)

    def _tell_all(self, notes: list[dict]) -> None:
        for note in notes:
            data = json.dumps(note, ensure_ascii=False, separators=(",", ":")).encode()
            if len(data) > NOTE_BYTES:  # a job name past MAX_JOB_BYTES: Attach refuses those
                log.error("node %d: a layout note of %d bytes is too long to tell", self.node, len(data))
                continue
            for peer in range(self._plane.size):
                if peer != self.node:
                    self._plane.note(peer, data, ATTACHED)

    def _changed(self, job: str) -> None:
        for listener in self._listeners:
            try:
                listener(job)
            except Exception:  # one listener's bug must not stop the others or the notes
                log.exception("node %d: a layout listener failed for job %r", self.node, job)


def _batches(ranks: Iterable[int]) -> Iterator[list[list[int]]]:
    """Runs [first, last] of consecutive ranks, _RUNS to a batch."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    for i in range(0, len(runs), _RUNS):
        yield runs[i : i + _RUNS]


def _ranks(runs: list[list[int]], world_size: int) -> list[int]:
    """The ranks of ``runs``, those of the world only (a peer's note is trusted to be
    well-formed, not to be small)."""
    return [r for first, last in runs for r in range(max(0, int(first)), min(int(last), world_size - 1) + 1)]
