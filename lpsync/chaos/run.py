"""A chaos run: trainers keep checking collectives while daemons, clients and links fail.

    sudo lpsync chaos --seconds 60 [--faults N] --seed 1 [--json]      (lpsync/commands/chaos.py)

On an emulated cluster (default 4 nodes x 2 ranks, plain TCP peers) every trainer runs
allreduces and broadcasts whose results it checks against numpy on every call
(lpsync.chaos.trainer). A seeded schedule injects one fault at a time: SIGKILL or
SIGSTOP a daemon or a trainer, cut a node's link in one direction or both; holds it a
while; then releases it (SIGCONT, restore, restart what it killed). After each release
the run waits until a collective of all ranks succeeds again: in the same job if the fault
broke nothing, else in a fresh job (an epoch), announced once every rank has failed in the
old one (or a collective's timeout has passed). The checks and the table:
lpsync.chaos.report. Everything is torn down at the end, also on failure and Ctrl-C;
exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lpsync.chaos.nodes import Nodes, Trainer, alive, shm_segments
from lpsync.chaos.report import Bounds, Record
from lpsync.cluster import Cluster, ClusterSpec, existing, faults
from lpsync.daemon import launch

KINDS = ("kill-daemon", "stop-daemon", "kill-client", "stop-client", "cut-both", "cut-one")
CUT_MODES = {"cut-both": "drop", "cut-one": "drop-out"}


class Chaos:
    def __init__(self, spec: ClusterSpec, tmp: Path, args: argparse.Namespace) -> None:
        self.args, self.spec = args, spec
        self.per_node, self.world = args.per_node, spec.nodes * args.per_node
        self.rng = random.Random(args.seed)
        self.record = Record(Bounds(args.heartbeat_timeout, args.timeout, args.rejoin_bound, args.slack))
        self.nodes = Nodes(spec, tmp, args.transport, args.heartbeat_timeout)
        self.reports: queue.Queue[Any] = queue.Queue()
        self.trainers: list[Trainer] = []
        self.epoch = 0
        self._seen = threading.Condition()
        self._ok: dict[int, dict[int, float]] = {}  # epoch -> rank -> start of its last OK collective
        self._failed: dict[int, set[int]] = {}  # epoch -> ranks that failed in it
        self._pids: list[int] = []  # every process we started, checked at the end
        self._cut: tuple[int, str] | None = None

    # -- processes -----------------------------------------------------------------------

    def start(self) -> None:
        self.nodes.start_all()
        self._pids += [d.pid for d in self.nodes.daemons if d is not None]
        self.trainers = [self._trainer(r) for r in range(self.world)]
        threading.Thread(target=self._collect, name="reports", daemon=True).start()
        self._new_epoch()
        if not self._rejoined(self.epoch, time.monotonic() + 120.0):
            raise RuntimeError("the first collective of all ranks never succeeded")

    def _trainer(self, rank: int) -> Trainer:
        node = rank // self.per_node
        t = Trainer(self.nodes.socket(node), rank, self.world, self.per_node, self.args.timeout, self.reports)
        self._pids.append(t.proc.pid)
        return t

    def _collect(self) -> None:
        while True:
            report = self.reports.get()  # blocks
            with self._seen:
                self.record.reports.append(report)
                if report["outcome"] == "ok":
                    self._ok.setdefault(report["epoch"], {})[report["rank"]] = report["start"]
                else:
                    self._failed.setdefault(report["epoch"], set()).add(report["rank"])
                self._seen.notify_all()

    def _new_epoch(self) -> None:
        with self._seen:
            self.epoch += 1
        for t in self.trainers:
            t.epoch(self.epoch)

    def _rejoined(self, epoch: int, deadline: float) -> bool:
        """Wait until every rank succeeded in ``epoch`` (True) or one failed in it (False)."""
        with self._seen:
            self._seen.wait_for(
                lambda: len(self._ok.get(epoch, ())) == self.world or epoch in self._failed,
                max(0.0, deadline - time.monotonic()),
            )
            return len(self._ok.get(epoch, ())) == self.world

    def _carried_on(self, epoch: int, since: float, deadline: float) -> bool:
        """Wait until every rank succeeded in ``epoch`` with a collective that started
        after ``since`` (True: the fault did not break the job) or one failed in it."""
        with self._seen:
            self._seen.wait_for(
                lambda: self._all_ok_since(epoch, since) or epoch in self._failed,
                max(0.0, deadline - time.monotonic()),
            )
            return self._all_ok_since(epoch, since)

    def _all_ok_since(self, epoch: int, since: float) -> bool:
        ok = self._ok.get(epoch, {})
        return len(ok) == self.world and min(ok.values()) >= since

    def _settled(self, epoch: int) -> None:
        """After a failure in ``epoch``: wait until every rank has left it (reported its
        failure), at most a collective's timeout plus slack (a rank that was killed and
        restarted never reports one). A rank still inside the epoch's collective when the
        next epoch is announced would join that one late, after the others failed it again
        without it: the ranks would chase each other from epoch to epoch and never meet."""
        with self._seen:
            self._seen.wait_for(
                lambda: len(self._failed.get(epoch, ())) == self.world,
                self.args.timeout + self.args.slack,
            )

    # -- one fault -----------------------------------------------------------------------

    def one_fault(self) -> None:
        kind = self.rng.choice(KINDS)
        node = self.rng.randrange(self.spec.nodes)
        rank = self.rng.randrange(self.world)
        hold = self.rng.uniform(0.5, 2.0 * self.args.heartbeat_timeout)
        self.record.faults[kind] += 1
        injected = time.monotonic()
        self.record.event(injected)
        if kind == "kill-daemon":
            self.nodes.kill(node)
        elif kind == "stop-daemon":
            self.nodes.signal(node, signal.SIGSTOP)
        elif kind == "kill-client":
            self.trainers[rank].proc.kill()
        elif kind == "stop-client":
            self.trainers[rank].proc.send_signal(signal.SIGSTOP)
        else:
            self._cut = (node, CUT_MODES[kind])
            faults.cut(self.spec, node, CUT_MODES[kind])
        time.sleep(hold / 2)
        self._survivors_serve(node if kind.endswith("daemon") or kind.startswith("cut") else None)
        time.sleep(hold / 2)
        # The release is an event from the moment it is made: a daemon woken by SIGCONT
        # may report before this thread runs again, and that report is owed to the release.
        released = time.monotonic()
        self.record.event(released)
        self._release(kind, node, rank)
        self.record.log.append(
            {"fault": kind, "node": node, "rank": rank, "injected": injected, "released": released}
        )
        deadline = released + self.args.rejoin_bound
        # A fault that broke nothing: the job goes on. A job is only left once every rank
        # failed in it: a rank that moved to a new job while the others were still in a
        # collective of the old one would leave them waiting out their timeout for it.
        rejoined = self._carried_on(self.epoch, released, deadline)
        while not rejoined:  # a fresh job until one collective of all ranks succeeds
            if time.monotonic() >= deadline:
                self.record.rejoin_failures.append(
                    f"{kind} node {node} rank {rank}: not within {self.args.rejoin_bound:.0f} s"
                )
                return
            self._settled(self.epoch)
            time.sleep(0.5)  # the meshes may still be healing: try again shortly
            self._new_epoch()
            rejoined = self._rejoined(self.epoch, deadline)
        self.record.rejoins.append(time.monotonic() - released)

    def _release(self, kind: str, node: int, rank: int) -> None:
        if kind == "kill-daemon":
            daemon = self.nodes.start(node)
            self._pids.append(daemon.pid)
        elif kind == "stop-daemon":
            self.nodes.signal(node, signal.SIGCONT)
        elif kind == "kill-client":
            self.trainers[rank].proc.wait(5)
            self.trainers[rank] = self._trainer(rank)
        elif kind == "stop-client":
            self.trainers[rank].proc.send_signal(signal.SIGCONT)
        elif self._cut is not None:
            faults.restore(self.spec, *self._cut)
            self._cut = None

    def _survivors_serve(self, faulted: int | None) -> None:
        for n in range(self.spec.nodes):
            if n == faulted:
                continue
            self.record.health_checks += 1
            if not launch.serving(self.nodes.socket(n), timeout=5.0):
                self.record.health_failures.append(
                    f"node {n} did not answer health while node {faulted} was faulted"
                )

    # -- the end -------------------------------------------------------------------------

    def teardown(self) -> None:
        """Undo a fault in progress, stop trainers and daemons, record how they ended."""
        if self._cut is not None:
            faults.restore(self.spec, *self._cut)
            self._cut = None
        for d in self.nodes.daemons:
            if d is not None and d.alive():
                d.proc.send_signal(signal.SIGCONT)
        for t in self.trainers:
            t.stop(grace=self.args.timeout + 5.0)
        self.record.exits = self.nodes.stop_all()
        self.record.reclaimed = self.nodes.reclaim()

    def leaks(self, prefix: str) -> None:
        """After the cluster is down: what is left of anything we started."""
        self.record.leaks = {
            "shared memory": [s for pid in self._pids for s in shm_segments(pid)],
            "sockets": [
                p
                for n in range(self.spec.nodes)
                for p in (self.nodes.socket(n), self.nodes.socket(n) + ".trigger")
                if Path(p).exists()
            ],
            "namespaces": existing(prefix),
            "processes": [str(pid) for pid in self._pids if alive(pid)],
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = args.prefix or f"lpc{os.getpid() % 100000}"
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = args.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="lpsync-chaos-"))
        with Cluster(args.nodes, 1_000_000_000, prefix=prefix) as cluster:
            chaos = Chaos(cluster.spec, Path(tmp), args)
            try:
                chaos.start()
                end = time.monotonic() + args.seconds
                while time.monotonic() < end and not (
                    args.faults and chaos.record.faults.total() >= args.faults
                ):
                    time.sleep(chaos.rng.uniform(0.5, 2.0))  # quiet: the job trains
                    chaos.one_fault()
            finally:
                chaos.teardown()
        chaos.leaks(prefix)
        if args.keep:  # every fault and every trainer's report, for a post-mortem
            with open(Path(tmp) / "chaos.jsonl", "w") as out:
                for entry in sorted(
                    chaos.record.log + chaos.record.reports,
                    key=lambda e: e.get("injected", e.get("start", 0.0)),
                ):
                    out.write(json.dumps(entry) + "\n")
    return chaos.record.summary()
