"""Partitions on the emulated cluster (root): three daemons in network namespaces, two
client processes per node, node 1's link cut mid-collective in three ways (port down,
every packet dropped, only its uploads dropped) and brought back. Every rank gets
UNAVAILABLE within the heartbeat bound, the others' errors name node 1, and after the
link returns the mesh heals by itself: the same clients' next collectives are correct."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.harness import DaemonProcess, helper_context, run_ranks, shm_segments
from tests.daemon.multinode_workers import attempt, through_partition, until_unavailable
from tests.daemon.security_workers import allreduces

pytest.importorskip("ucxx")
if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
    pytest.skip("network namespaces need root and iproute2 (ip, tc)", allow_module_level=True)

from lpsync.cluster import Cluster, faults
from lpsync.daemon import launch

NODES, PER_NODE, CUT = 3, 2, 1
WORLD = NODES * PER_NODE
HEARTBEAT = 3.0
BOUND = HEARTBEAT + 2.0  # detection (timeout + one watchdog tick) plus a loaded CI box
PORT = 13337


class NetCluster:
    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster, self.spec = cluster, cluster.spec
        peers = ",".join(f"{cluster.address(i)}:{PORT}" for i in range(NODES))
        env = {"LPSYNC_SECRET": secrets.token_hex(16), "LPSYNC_UCX_TLS": "tcp"}
        self.daemons: list[DaemonProcess] = []
        for node in range(NODES):
            where = tmp / f"node{node}"
            where.mkdir()
            self.daemons.append(
                DaemonProcess(
                    where,
                    "--peers",
                    peers,
                    "--node-rank",
                    str(node),
                    "--heartbeat-timeout",
                    str(HEARTBEAT),
                    "--peer-transport",
                    "ucx",  # what these cuts were written against; tcp: test_daemon_multinode.py
                    env=env,
                    wrap=("ip", "netns", "exec", self.spec.namespace(node)),
                )
            )
        self.wait_meshes([0] * NODES, 90)

    @property
    def sockets(self) -> list[str]:
        return [d.socket for d in self.daemons]

    def log(self, node: int) -> str:
        return self.daemons[node].log.read_text()

    def meshes(self) -> list[int]:
        return [self.log(n).count("peer mesh up") for n in range(NODES)]

    def wait_meshes(self, before: list[int], timeout: float) -> float:
        """Wait until every node has brought up a mesh since ``before``; seconds taken."""
        start = time.monotonic()
        while not all(now > then for now, then in zip(self.meshes(), before, strict=True)):
            if time.monotonic() - start > timeout:
                raise AssertionError(
                    f"meshes not up within {timeout:.0f} s: {self.meshes()} "
                    f"(before: {before})\n{self.log(0)[-3000:]}"
                )
            time.sleep(0.2)
        return time.monotonic() - start

    def stop(self) -> list[str]:
        unclean, codes = [], launch.stop_together(self.daemons)
        for node, (daemon, rc) in enumerate(zip(self.daemons, codes, strict=True)):
            if rc != 0:
                unclean.append(f"node {node} exited with {rc}:\n{daemon.log.read_text()[-3000:]}")
            if left := shm_segments(daemon.pid):
                unclean.append(f"node {node} left shared memory: {left}")
        return unclean


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    with Cluster(NODES, 1_000_000_000, prefix="lphn") as cluster:
        c = NetCluster(cluster, tmp_path_factory.mktemp("partition"))
        try:
            yield c
        except BaseException:
            c.stop()
            raise
        # Daemons that lived through partitions and rebuilt their mesh still stop cleanly.
        assert not (unclean := c.stop()), "\n".join(unclean)


@pytest.mark.parametrize("mode", faults.MODES)
def test_a_cut_node_is_unavailable_everywhere_and_the_mesh_heals(net: NetCluster, mode: str) -> None:
    ctx = helper_context()
    ready, cut_done, healed = ctx.Event(), ctx.Event(), ctx.Event()
    box: dict[str, Any] = {}

    def clients() -> None:
        try:
            box["results"] = run_ranks(
                WORLD,
                through_partition,
                net.sockets,
                PER_NODE,
                f"cut-{mode}",
                WORLD,
                CUT,
                ready,
                cut_done,
                healed,
                timeout=240,
            )
        except BaseException as error:  # reported below
            box["error"] = error

    runner = threading.Thread(target=clients)
    runner.start()
    restored = False
    try:
        assert ready.wait(90), "the first collective never completed"
        time.sleep(1.0)  # nodes 0 and 2 now wait inside the next collective for node 1
        before = net.meshes()
        cut_at = time.monotonic()
        faults.cut(net.spec, CUT, mode)
        cut_done.set()
        time.sleep(BOUND + 1.0)  # everyone has failed by now (checked below)
        faults.restore(net.spec, CUT, mode)
        restored = True
        healed_in = net.wait_meshes(before, 120)
        healed.set()
    finally:
        if not restored:
            faults.restore(net.spec, CUT, mode)
        cut_done.set()
        healed.set()
        runner.join(240)
    assert not runner.is_alive()
    assert "error" not in box, box.get("error")
    for rank, (kind, at, message, after) in enumerate(box["results"]):
        assert kind == "UnavailableError", (rank, kind, message)
        assert at - cut_at < BOUND, (rank, round(at - cut_at, 2), message)
        if rank // PER_NODE != CUT:
            assert "node 1" in message, (rank, message)
        assert after == [True] * 3, (rank, after)
    for node in range(NODES):
        assert "peer mesh lost" in net.log(node)
    worst = max(at - cut_at for _, at, _, _ in box["results"])
    print(
        f"{mode}: every rank UNAVAILABLE within {worst:.2f} s, healed {healed_in:.1f} s "
        f"after the link came back; rank 0 saw: {box['results'][0][2]}"
    )


def _failed_across(socket: str, job: str) -> list[tuple[int, dict[int, str], bool]]:
    """(sequence, code by node, split) of ``job``'s collectives that failed on some node,
    as the daemon at ``socket`` reports them."""
    status = launch.status(socket, recent=1000)
    return [
        (f.sequence, {n.node: n.code for n in f.nodes}, f.split) for f in status.failed_across if f.job == job
    ]


def test_a_cut_while_data_moves_fails_every_rank_within_the_bound(net: NetCluster) -> None:
    """Node 1 cut (every packet dropped) while large LP allreduces stream through it: every
    rank of every node fails with UNAVAILABLE within the heartbeat bound, nobody hangs, and
    once the link is back the mesh heals, every node's status names each node's outcome
    of the cut collective alike, and a job's collectives are correct again."""
    ctx = helper_context()
    ready = ctx.Event()
    box: dict[str, Any] = {}

    def clients() -> None:
        try:
            box["results"] = run_ranks(
                WORLD, until_unavailable, net.sockets, PER_NODE, "cut-data", WORLD, ready, 60.0, timeout=120
            )
        except BaseException as error:  # reported below
            box["error"] = error

    runner = threading.Thread(target=clients)
    runner.start()
    try:
        assert ready.wait(90), "the collectives never got going"
        before = net.meshes()
        cut_at = time.monotonic()
        faults.cut(net.spec, CUT, "drop")
        runner.join(BOUND + 30)
        # While node 1 is still cut off, a new job's collective fails within the heartbeat
        # timeout, saying why, instead of waiting out its own 60 s for a mesh.
        while_cut = run_ranks(WORLD, attempt, net.sockets, PER_NODE, "while-cut", WORLD, timeout=120)
    finally:
        faults.restore(net.spec, CUT, "drop")
        runner.join(120)
    assert not runner.is_alive()
    assert "error" not in box, box.get("error")
    for rank, (kind, at, done, message) in enumerate(box["results"]):
        assert kind == "UnavailableError", (rank, kind, message)
        assert at - cut_at < BOUND, (rank, round(at - cut_at, 2), done, message)
    for rank, (kind, seconds, message) in enumerate(while_cut):
        assert kind == "UnavailableError", (rank, kind, message)
        assert seconds < BOUND, (rank, seconds, message)
        assert "down and rebuilding" in message or "lost a peer" in message, message
        if rank // PER_NODE != CUT:
            assert "node 1" in message, (rank, message)
    net.wait_meshes(before, 120)
    # The nodes told each other their outcomes on the new mesh: every node's status names
    # each node's outcome of the cut collectives alike, and each node's failure is there.
    views = [_failed_across(socket, "cut-data") for socket in net.sockets]
    assert views[0] == views[1] == views[2], views
    for node in range(NODES):
        assert any(codes[node] == "UNAVAILABLE" for _, codes, _ in views[0]), (node, views[0])
    for _, codes, split in views[0]:
        assert split == ("OK" in codes.values() and "UNAVAILABLE" in codes.values()), views[0]
    printed = subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "status", "--socket", net.sockets[2], "--recent", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "collectives that failed on some node" in printed, printed
    for sequence, _, split in views[0]:
        line = next(x for x in printed.splitlines() if f"cut-data #{sequence}:" in x)
        assert ("SPLIT" in line) == split and "UNAVAILABLE on node" in line, line
    for _, _, _, message in box["results"]:
        if "lost a peer node" in message:
            assert "`lpsync status` on any node names each node's outcome" in message, message
    # A node that finished the cut collective before the others failed it is one
    # collective ahead of them (docs/security.md, known limits): a new job starts even.
    assert (
        run_ranks(WORLD, allreduces, net.sockets, PER_NODE, "after-cut-data", WORLD, 3, timeout=120)
        == [[True] * 3] * WORLD
    )
