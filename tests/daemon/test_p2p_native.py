"""A repeated send/recv is answered by the engine, like a collective (docs/architecture.md,
"The native steady-state path"): two ranks on one daemon with --native on, blocking and
asynchronous calls on the same buffers, and plain numpy arrays, every message against
numpy; each pair job's repeats rung from its third call; the main client's released
buffer unmapped by the daemon at once, and the pair jobs' copies once the client closed.
With --native off the same calls are right and nothing is armed. After a pair is armed,
a sender that dies and a receive of another size fail as they do on the general path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lpsync.native import engine as native_engine
from tests.daemon.harness import DaemonProcess, PeeredDaemons, run_ranks
from tests.daemon.p2p_workers import armed_then, repeated_pair
from tests.ports import free_ports

CALLS = 6


@pytest.mark.parametrize("native", ["on", "off"])
def test_a_repeated_send_recv_is_answered_by_the_engine(tmp_path: Path, native: str) -> None:
    if native == "on":
        assert native_engine() is not None, "the native engine is not built (the install builds it)"
    daemon = DaemonProcess(tmp_path, "--native", native)
    try:
        sockets, pids = [daemon.socket] * 2, [daemon.pid] * 2
        results = run_ranks(
            2, repeated_pair, sockets, pids, free_ports(1)[0], f"p2p-{native}", CALLS, timeout=120
        )
    finally:
        daemon.stop_and_check()
    _check(results, native)


def test_a_repeated_send_recv_across_daemons_is_answered_by_their_engines(tmp_path: Path) -> None:
    """Each rank on its own daemon (TCP peers): the pair jobs span both, and their repeats
    run as the daemons' armed node programs."""
    cluster = PeeredDaemons(tmp_path, 2, "--peer-transport", "tcp", "--native", "on")
    try:
        pids = [d.pid for d in cluster.daemons if d is not None]
        results = run_ranks(
            2, repeated_pair, cluster.sockets, pids, free_ports(1)[0], "p2p-on", CALLS, timeout=180
        )
    finally:
        assert not (unclean := cluster.stop()), "\n".join(unclean)
    _check(results, "on")


def _check(results: list[dict], native: str) -> None:
    for rank, found in enumerate(results):
        assert found["wrong"] == [], (rank, found["wrong"])
        assert found["main_mapped"] and found["main_left"] == [], (rank, found)
        assert found["owned"] >= 4 and found["all_left"] == [], (rank, found)  # x, 3 pair copies
        jobs = found["jobs"]
        pairs = {f"p2p-{native}/p2p/0>1/{tag}" for tag in (0, 5, 9)}
        assert pairs <= set(jobs), jobs
        for job in pairs:
            path, answered, armed = jobs[job]
            if native == "on":  # calls 3..CALLS rang (each rank's status: its daemon's count)
                assert path.startswith("native") and answered >= CALLS - 2 and armed >= 1, (job, jobs[job])
            else:
                assert answered == 0 and armed == 0, (job, jobs[job])


def test_an_armed_receive_whose_sender_dies_fails_at_once(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--native", "on")
    try:
        (result,) = [r for r in run_ranks(2, armed_then, daemon.socket, "p2p-dies", "dies", dies=(0,)) if r]
    finally:
        daemon.stop_and_check()
    message, seconds = result
    assert message.startswith("AbortedError") and re.search(r"rank(\(s\))? 0\b", message), message
    assert seconds < 5.0, seconds


def test_an_armed_pair_receiving_another_size_fails_both_sides(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--native", "on")
    try:
        results = run_ranks(2, armed_then, daemon.socket, "p2p-size", "size")
    finally:
        daemon.stop_and_check()
    for rank, (message, seconds) in enumerate(results):
        assert message.startswith("MismatchError"), (rank, message)
        assert "count" in message and "8" in message and "6" in message, message
        assert seconds < 5.0, seconds
