"""A tuner that learns: node 0 times the close candidates on a job's first calls of a size.

The link model alone mispredicts on real links (on 8 emulated nodes at 256 KiB it picks
BE for broadcast, 15.4 ms, where MST takes 9.6: docs/benchmarks.md at 623decd). So for a multi-node
collective whose algorithm is not forced, the tuner's answer is a shortlist: every
candidate the model predicts within SHORTLIST x of the fastest (a pipelined one also with
half and twice its chunk count: the model leaves per-message CPU out). Node 0 decides for every
node: its agreement summary says which candidate to run ("use", with its chunk count) and
whether that run is a trial; the verdict carries node 0's word to all (agreement.py), so
every node builds the same schedule. Each node reports how long its share of a trial took
in its summary of the job's next collective ("last"); node 0 counts the slowest node's
time. Once every shortlisted candidate has TRIALS timed runs, node 0 keeps the one with
the lowest median for that (op, bytes) of the job, and says so in every later summary;
of the candidates within NEAR of that median it keeps the one with the fewest chunks.
Two trials cannot tell such times apart, and each message costs CPU on every node on
every later call: on 8 emulated nodes a 64 MiB broadcast in twice the chunks was 1.6%
faster and cost 30% more CPU (docs/benchmarks.md).

State lives with the job (one Learner per job and node), so a job's later calls of a
size pay no trials; a restarted job learns again.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from lpsync.algorithms import LinkModel
from lpsync.algorithms.cost import closed_form
from lpsync.algorithms.registry import ALGORITHMS
from lpsync.algorithms.tuner import MAX_CANDIDATES, TRIALS, Choice, predictions
from lpsync.types import Collective

log = logging.getLogger("lpsync.daemon")

SHORTLIST = 2.0  # candidates predicted within this factor of the fastest are tried
MIN_VARIANT_CHUNK = 32 * 1024  # bytes: no chunk count variant cuts finer than this
NEAR = 0.02  # measured medians this close to the fastest count as ties: fewest chunks wins

Key = tuple[str, int]  # (op, nccl-tests bytes)
Pick = tuple[str, int]  # (algorithm, chunks)


def candidates(op: Collective, nbytes: int, participants: int, link: LinkModel) -> list[Choice]:
    """The model's candidates, and for a pipelined one also half and twice its chunk count:
    per-message CPU, which the model leaves out, moves the best count (docs/benchmarks.md)."""
    out = []
    for choice in predictions(op, nbytes, participants, link):
        out.append(choice)
        if not ALGORITHMS[choice.algorithm].pipelined:
            continue
        for chunks in (choice.chunks // 2, choice.chunks * 2):
            if chunks >= 1 and chunks != choice.chunks and nbytes // chunks >= MIN_VARIANT_CHUNK:
                out.append(
                    Choice(
                        choice.algorithm,
                        chunks,
                        closed_form(op, choice.algorithm, participants, nbytes, link, chunks),
                    )
                )
    return out


@dataclass
class _Size:
    shortlist: list[Choice]
    issued: dict[Pick, int] = field(default_factory=dict)  # trials handed out per candidate
    times: dict[Pick, list[float]] = field(default_factory=dict)  # measured, per candidate
    best: Choice | None = None


def _pick(choice: Choice) -> Pick:
    return (choice.algorithm, choice.chunks)


def _trials(size: _Size) -> str:
    """The kept candidate and every candidate's measured times, for the log."""
    best = size.best
    timed = ", ".join(
        f"{c.algorithm}/{c.chunks} {statistics.median(size.times[_pick(c)]) * 1e3:.2f} ms"
        for c in sorted(size.shortlist, key=lambda c: statistics.median(size.times[_pick(c)]))
    )
    return f"kept {best.algorithm}/{best.chunks} chunks of ({timed})" if best else timed


def _keep(size: _Size) -> Choice:
    """The fewest chunks among the candidates timed within NEAR of the fastest median
    (then the faster of those)."""
    medians = {_pick(c): statistics.median(size.times[_pick(c)]) for c in size.shortlist}
    fastest = min(medians.values())
    near = [c for c in size.shortlist if medians[_pick(c)] <= fastest * (1 + NEAR)]
    return min(near, key=lambda c: (c.chunks, medians[_pick(c)]))


class Learner:
    """One job's learning on one node (the job makes it: matching.Job.place): node 0
    chooses (``choose``, ``report``), every node keeps the time of its latest trial to
    report (``ran``, ``take_last``)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self._lock = threading.Lock()
        self._sizes: dict[Key, _Size] = {}
        # node 0: sequence -> (key, candidate, {node: seconds}) of trials not yet timed by all
        self._pending: dict[int, tuple[Key, Pick, dict[int, float]]] = {}
        self._last: tuple[int, float] | None = None  # this node's latest trial: (seq, s)

    # -- node 0 --------------------------------------------------------------------------
    def choose(self, key: Key, predict: Callable[[], list[Choice]], sequence: int) -> tuple[Choice, bool]:
        """What collective ``sequence`` runs for ``key`` and whether it is a trial (then
        handed out: ``report`` times it). ``predict()``: the model's candidates
        (``candidates``), asked the first time ``key`` is seen."""
        choice, trial = self._choose(key, predict)
        if trial:
            self._issued(sequence, key, choice)
        return choice, trial

    def _choose(self, key: Key, predict: Callable[[], list[Choice]]) -> tuple[Choice, bool]:
        with self._lock:
            size = self._sizes.get(key)
            if size is None:
                predicted = predict()
                fastest = min(c.seconds for c in predicted)
                shortlist = sorted(
                    (c for c in predicted if c.seconds <= fastest * SHORTLIST), key=lambda c: c.seconds
                )[:MAX_CANDIDATES]
                size = self._sizes[key] = _Size(shortlist)
                if len(shortlist) == 1:
                    size.best = shortlist[0]
            if size.best is not None:
                return size.best, False
            fewest = min(size.shortlist, key=lambda c: size.issued.get(_pick(c), 0))
            if size.issued.get(_pick(fewest), 0) < TRIALS:
                size.issued[_pick(fewest)] = size.issued.get(_pick(fewest), 0) + 1
                return fewest, True
            # Every trial handed out, some not timed yet: the model's pick meanwhile.
            return min(size.shortlist, key=lambda c: c.seconds), False

    def _issued(self, sequence: int, key: Key, choice: Choice) -> None:
        """Node 0 runs trial ``sequence`` of ``choice``."""
        with self._lock:
            self._pending[sequence] = (key, _pick(choice), {})
            while len(self._pending) > 64:  # trials whose reports never came (failures)
                self._pending.pop(next(iter(self._pending)))

    def abandon(self, sequence: int) -> None:
        """Trial ``sequence`` failed before it could be timed: hand it out again."""
        with self._lock:
            entry = self._pending.pop(sequence, None)
            if entry is not None:
                size = self._sizes[entry[0]]
                size.issued[entry[1]] -= 1

    def report(self, node: int, sequence: int, seconds: float) -> None:
        """``node`` took ``seconds`` for its share of trial ``sequence`` (node 0 reports
        its own too); once every node has, the slowest time counts."""
        with self._lock:
            entry = self._pending.get(sequence)
            if entry is None:
                return
            key, pick, got = entry
            got[node] = seconds
            if len(got) < self.nodes:
                return
            del self._pending[sequence]
            size = self._sizes[key]
            size.times.setdefault(pick, []).append(max(got.values()))
            if all(len(size.times.get(_pick(c), ())) >= TRIALS for c in size.shortlist):
                size.best = _keep(size)
                log.info("learned %s of %d bytes: %s", key[0], key[1], _trials(size))

    def learned(self, key: Key) -> Choice | None:
        with self._lock:
            size = self._sizes.get(key)
            return None if size is None else size.best

    # -- every node ----------------------------------------------------------------------
    def ran(self, sequence: int, seconds: float) -> None:
        """This node ran trial ``sequence`` in ``seconds``: reported with the next summary
        (a report sent twice counts once). A later trial's time replaces an unsent one."""
        with self._lock:
            if self._last is None or self._last[0] <= sequence:
                self._last = (sequence, seconds)

    def take_last(self) -> tuple[int, float] | None:
        with self._lock:
            last, self._last = self._last, None
            return last
