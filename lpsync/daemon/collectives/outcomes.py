"""Each node's outcome of the last cross-node collectives, told to the others on every
new mesh: so that every node's `lpsync status` names which nodes finished a collective
that a cut failed on some of them (docs/reliability.md, "One outcome per collective").

Why a report and not a second agreement round: a link cut while data moves can leave
one node with the result and another with an error. A final verdict from node 0 before
results are released would cost a second tree round on every collective (about as much
as the first: the agreement is most of a small collective's time) and would still not
close the gap, since the verdict's own messages can be cut between the nodes it reaches
and those it does not. A cut always breaks the mesh (heartbeats), and the nodes tell
each other here when it comes back, before it serves a collective.

Keys are (job name, sequence); a job restarted under the same name starts its sequences
again and replaces the old keys as its collectives finish on this node.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lpsync.daemon.collectives import agreement

log = logging.getLogger("lpsync.daemon")

TOLD = 64  # this node's last cross-node outcomes that a new mesh hears of
KEPT = 256  # collectives whose outcomes on the nodes are kept, oldest dropped first
MAX_BYTES = 64 * 1024  # one node's message, framed; larger ones are cut to fit


@dataclass
class Across:
    """One cross-node collective: the job's daemons (node ranks in --peers) and the code
    each reported ("OK" or a gRPC code name); a daemon not in ``codes`` has not said."""

    job: str
    sequence: int
    daemons: tuple[int, ...]
    codes: dict[int, str] = field(default_factory=dict)

    def split(self) -> bool:
        """Some nodes finished it and some failed it: their buffers differ."""
        return "OK" in self.codes.values() and any(c != "OK" for c in self.codes.values())

    def describe(self) -> str:
        return describe(self.daemons, self.codes)


def describe(daemons: Sequence[int], codes: Mapping[int, str]) -> str:
    """'OK on nodes 0, 2; UNAVAILABLE on node 1; not heard from node 3' (codes by node;
    a node missing or with "" has not said)."""
    by_code: dict[str, list[int]] = {}
    for daemon in daemons:
        by_code.setdefault(codes.get(daemon, ""), []).append(daemon)
    parts = []
    for code, nodes in by_code.items():
        where = ("node " if len(nodes) == 1 else "nodes ") + ", ".join(map(str, nodes))
        parts.append(f"{code} on {where}" if code else f"not heard from {where}")
    return "; ".join(parts)


class Outcomes:
    """The outcomes table of one daemon (``me``: its node rank in --peers); thread-safe."""

    max_bytes = MAX_BYTES  # for the peer plane's receive buffers (plane.Exchange)

    def __init__(self, me: int) -> None:
        self.me = me
        self._lock = threading.Lock()
        # Oldest first; ran() moves its entry to the end, so this node's own entries are in
        # the order it finished them.
        self._table: OrderedDict[tuple[str, int], Across] = OrderedDict()

    def ran(self, job: str, sequence: int, daemons: tuple[int, ...], code: str) -> None:
        """This node's outcome of a cross-node collective (after its replies)."""
        key = (job, sequence)
        with self._lock:
            entry = self._table.pop(key, None)
            if entry is None or entry.daemons != daemons or self.me in entry.codes:
                entry = Across(job, sequence, daemons)  # new, or a restarted job's: fresh
            entry.codes[self.me] = code
            self._table[key] = entry
            while len(self._table) > KEPT:
                self._table.popitem(last=False)

    def message(self) -> np.ndarray:
        """What this node tells the others on a new mesh: its last outcomes, framed
        (agreement.encode), the oldest left out where they would not fit MAX_BYTES."""
        with self._lock:
            mine = [e for e in self._table.values() if self.me in e.codes]
            told = [[e.job, e.sequence, list(e.daemons), e.codes[self.me]] for e in mine[-TOLD:]]
        while True:
            out = agreement.encode({"outcomes": told})
            if out.nbytes <= MAX_BYTES or not told:
                return out
            told = told[len(told) // 4 + 1 :]

    def heard(self, told: Mapping[int, np.ndarray]) -> list[Across]:
        """Merge what the other nodes told (by node rank); the collectives that this
        shows split for the first time, logged once each with every node's outcome."""
        split: dict[tuple[str, int], Across] = {}
        for daemon, message in told.items():
            for entry in self._merge(daemon, message):
                split[entry.job, entry.sequence] = entry
        for entry in split.values():
            log.warning(
                "node %d: collective #%d of job %r finished on some nodes and failed on others "
                "(their ranks' buffers differ): %s",
                self.me,
                entry.sequence,
                entry.job,
                entry.describe(),
            )
        return list(split.values())

    def _merge(self, daemon: int, message: np.ndarray) -> list[Across]:
        try:
            header, _ = agreement.decode(message)
            told = [(str(j), int(s), tuple(int(d) for d in ds), str(c)) for j, s, ds, c in header["outcomes"]]
        except (ValueError, KeyError, TypeError) as error:
            log.warning("node %d: unreadable outcomes from node %d (%s); ignored", self.me, daemon, error)
            return []
        split = []
        with self._lock:
            for job, sequence, daemons, code in told:
                if daemon not in daemons:
                    continue  # not that node's to tell
                entry = self._table.get((job, sequence))
                if entry is None:
                    entry = self._table[job, sequence] = Across(job, sequence, daemons)
                elif entry.daemons != daemons:
                    continue  # another job of the same name: not comparable
                was = entry.split()
                entry.codes[daemon] = code
                if entry.split() and not was:
                    split.append(entry)
            while len(self._table) > KEPT:
                self._table.popitem(last=False)
        return split

    def failed(self, limit: int = 20) -> list[Across]:
        """The last ``limit`` collectives that failed on some node, oldest first."""
        with self._lock:
            out = [
                Across(e.job, e.sequence, e.daemons, dict(e.codes))
                for e in self._table.values()
                if any(c != "OK" for c in e.codes.values())
            ]
        return out[-limit:] if limit else []
