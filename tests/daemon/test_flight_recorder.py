"""The flight recorder (issue 8, point 8): `lpsync status` names what a collective waits for
and keeps each job's last collectives stage by stage; a stalled collective logs a warning
naming the missing ranks (or nodes) before its deadline. Real daemons, real `lpsync status`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync.daemon.collectives.matching import Job, Recorder
from lpsync.daemon.values import Arrival, Outcome, Pending, Spec
from lpsync.daemon.watcher import Watcher
from lpsync.errors import LpsyncError
from tests.daemon.harness import ROOT, DaemonProcess, PeeredDaemons, cli_status

STALL = 0.5


def status(socket: str, *args: str) -> dict:
    return json.loads(cli_status(socket, "--json", *args))


def status_text(socket: str) -> str:
    return cli_status(socket)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def job_info(socket: str, name: str, *args: str) -> dict | None:
    return next((j for j in status(socket, *args).get("jobs", []) if j["job"] == name), None)


def test_status_names_missing_ranks_and_records_each_stage(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--stall-seconds", str(STALL))
    try:
        clients = [
            lpsync_client.connect(daemon.socket, job="fr", rank=r, world_size=3, timeout=60) for r in range(3)
        ]
        arrays = [c.zeros(5, "float32") for c in clients]
        for r, a in enumerate(arrays):
            a[:] = np.arange(5, dtype=np.float32) * (r + 1)
        futures = [clients[r].allreduce_async(arrays[r]) for r in (0, 1)]

        def stalled() -> dict | None:
            job = job_info(daemon.socket, "fr")
            waiting = job["waiting"] if job else []
            return waiting[0] if waiting and waiting[0]["stalled"] else None

        waiting = wait_for(stalled, what="the collective to show as stalled")
        assert waiting["stage"] == "arriving"
        assert waiting["missing_ranks"] == [2] and waiting["arrived"] == [0, 1]
        assert waiting["waiting_seconds"] >= STALL
        text = status_text(daemon.socket)
        assert "STALLED" in text and "missing ranks 2 (arrived 0-1)" in text
        # The warning names the missing rank, before the collective's 60 s deadline.
        wait_for(lambda: "missing rank(s) 2" in daemon.log.read_text(), what="stall warning")

        time.sleep(0.2)
        clients[2].allreduce(arrays[2])
        for f in futures:
            f.result(timeout=30)
        expected = np.arange(5, dtype=np.float32) * 6
        for a in arrays:
            np.testing.assert_array_equal(a, expected)

        job = wait_for(
            lambda: (j := job_info(daemon.socket, "fr")) and j["history"] and j, what="the flight record"
        )
        assert job["waiting"] == [] and job["attached"] == [0, 1, 2]
        record = job["history"][-1]
        assert record["op"] == "allreduce" and record["code"] == "OK"
        assert record["dtype"] == "float32" and int(record["count"]) == 5
        arrivals = {a["rank"]: a["after_seconds"] for a in record["arrivals"]}
        assert set(arrivals) == {0, 1, 2} and min(arrivals.values()) == 0.0
        assert arrivals[2] >= STALL  # the late rank, as late as it was
        stages = [s["stage"] for s in record["stages"]]
        assert stages == ["arriving", "queued", "running"]
        assert record["stages"][0]["seconds"] == pytest.approx(arrivals[2], abs=1e-3)
        assert record["total_seconds"] >= sum(s["seconds"] for s in record["stages"]) - 1e-6
        for c in clients:
            c.close()
    finally:
        daemon.stop_and_check()


def test_history_keeps_the_last_n_and_failures(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--flight-recorder", "3")
    try:
        with (
            lpsync_client.connect(daemon.socket, job="h", rank=0, world_size=2) as c0,
            lpsync_client.connect(daemon.socket, job="h", rank=1, world_size=2) as c1,
        ):
            x0, x1 = c0.zeros(4), c1.zeros(4)
            for _ in range(4):
                f = c0.allreduce_async(x0)
                c1.allreduce(x1)
                f.result(timeout=30)
            with pytest.raises(lpsync_client.TimeoutError):
                c0.allreduce(x0, timeout=0.3)  # rank 1 never comes
            job = wait_for(
                lambda: (
                    (j := job_info(daemon.socket, "h"))
                    and j["history"][-1]["code"] == "DEADLINE_EXCEEDED"
                    and j
                ),
                what="the failed collective's record",
            )
            assert len(job["history"]) == 3  # --flight-recorder 3
            assert [int(r["sequence"]) for r in job["history"]] == [3, 4, 5]
            failed = job["history"][-1]
            assert "rank(s) 1 did not arrive" in failed["message"]
            assert [a["rank"] for a in failed["arrivals"]] == [0]
            assert [s["stage"] for s in failed["stages"]] == ["arriving"]
            assert len(job_info(daemon.socket, "h", "--history", "1")["history"]) == 1
    finally:
        daemon.stop_and_check()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_flight_recorder_size_is_checked_at_start(tmp_path: Path, value: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "daemon",
            "--socket",
            str(tmp_path / "s.sock"),
            "--flight-recorder",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode != 0 and "flight_recorder must be 1..100000" in out.stderr


def test_multinode_status_names_the_node_not_heard_from(tmp_path: Path) -> None:
    pytest.importorskip("ucxx")
    cluster = PeeredDaemons(tmp_path, 2, "--stall-seconds", str(STALL))
    daemons = cluster.daemons
    try:
        clients = [
            lpsync_client.connect(
                daemons[n].socket,
                job="mn",
                rank=n,
                world_size=2,
                local_rank=0,
                local_world_size=1,
                timeout=60,
            )
            for n in range(2)
        ]
        arrays = [c.zeros(3) for c in clients]
        arrays[0][:], arrays[1][:] = 1.0, 2.0
        future = clients[0].allreduce_async(arrays[0])  # node 1's rank does not come yet

        def agreeing() -> dict | None:
            job = job_info(daemons[0].socket, "mn")
            waiting = job["waiting"] if job else []
            return waiting[0] if waiting and waiting[0]["stalled"] else None

        waiting = wait_for(agreeing, what="node 0 waiting on node 1")
        assert waiting["stage"] == "agreeing"
        assert waiting["missing_nodes"] == [1] and waiting["missing_ranks"] == [1]
        wait_for(
            lambda: "node(s) 1 not heard from" in daemons[0].log.read_text(),
            what="the stall warning naming node 1",
        )
        clients[1].allreduce(arrays[1])
        future.result(timeout=30)
        for a in arrays:
            np.testing.assert_array_equal(a, np.full(3, 3.0, np.float32))
        job = wait_for(
            lambda: (j := job_info(daemons[0].socket, "mn")) and j["history"] and j,
            what="node 0's flight record",
        )
        assert job["nodes"] == 2 and job["node"] == 0
        stages = [s["stage"] for s in job["history"][-1]["stages"]]
        assert stages == ["arriving", "queued", "agreeing", "running"]
        for c in clients:
            c.close()
    finally:
        cluster.stop_and_check()


class Inline:  # a matching.JobRunner that runs each collective at once, keeping nothing
    def dispatch(self, job: Job, pending: Pending, run: Callable[[], None]) -> None:
        run()

    def run(self, job: Job, pending: Pending) -> Outcome:
        return Outcome()

    def finished(self, job: Job, pending: Pending, outcome: Outcome) -> None:
        pass

    def failed_here(self, job: Job, pending: Pending, error: LpsyncError) -> None:
        pass


def test_one_stall_watch_per_job_warns_for_each_stalled_collective_once(caplog) -> None:
    """The job's one stall timer (matching.Job._stall_sweep): a collective opened while the
    watch waits for an earlier one is still checked at its own threshold, each is warned
    about once, one that finishes in time never, and the watch disarms when nothing is open."""
    watcher = Watcher()
    finished: list[int] = []

    job = Job("sw", 2, watcher, Inline(), recorder=Recorder(stall_seconds=STALL))

    def arrive(rank: int, seq: int) -> None:
        spec = Spec("barrier", "float32", 0, 0, "", "", "")
        job.submit(Arrival(rank, seq, spec, 30.0, None, None, (), lambda o: finished.append(seq)))

    try:
        with caplog.at_level(logging.WARNING, logger="lpsync.daemon"):
            arrive(0, 1)
            time.sleep(STALL / 2)
            arrive(0, 2)  # opened while the watch is armed for #1
            arrive(0, 3)
            arrive(1, 3)  # finishes at once: never stalled
            time.sleep(STALL * 3)
            warned = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
            assert [w.split(" ")[1] for w in warned] == ["#1", "#2"]
            assert all("missing rank(s) 1" in w for w in warned)
            assert finished == [3, 3]
            arrive(1, 1)
            arrive(1, 2)
            assert sorted(finished) == [1, 1, 2, 2, 3, 3]
            assert {w.sequence for w in job.waiting()} == set()
            time.sleep(STALL * 2)
            assert job._stall_watch is None  # nothing open: disarmed
            assert len([r for r in caplog.records if "has waited" in r.getMessage()]) == 2
    finally:
        watcher.stop()


def test_an_arrival_stamped_before_the_one_that_opened_its_collective_opens_it(monkeypatch) -> None:
    """Two ranks stamp their arrivals on their own threads, then take the job's lock: the one
    stamped later may get there first. The collective opened at the earliest stamp, so no
    stage of its record is negative (a cluster bench saw arriving = -48 us)."""
    from lpsync.daemon.collectives import matching

    watcher = Watcher()
    stamps = iter([100.0, 99.9])  # rank 0 stamps at 100.0 and wins the lock; rank 1 at 99.9
    real = time.monotonic
    job = Job("early", 2, watcher, Inline(), recorder=Recorder())
    spec = Spec("barrier", "float32", 0, 0, "", "", "")
    try:
        for rank in (0, 1):
            monkeypatch.setattr(matching.time, "monotonic", lambda: next(stamps, None) or real())
            job.submit(Arrival(rank, 1, spec, 30.0, None, None, (), lambda o: None))
        monkeypatch.setattr(matching.time, "monotonic", real)
        (record,) = job.history
        assert all(seconds >= 0 for _, seconds in record.stages), record.stages
        assert dict(record.arrivals) == {0: pytest.approx(0.1), 1: 0.0}
    finally:
        watcher.stop()
