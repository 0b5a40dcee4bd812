"""Hostile peers on the peer plane (loopback, real daemons): a daemon of another cluster
(another secret) that keeps dialling, garbage and idle connections on both daemons' peer
ports, before and while the mesh serves a job; a replayed handshake. Each is refused and
logged, and the mesh is not disturbed: one mesh for the whole test, every collective
correct."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lpsync.errors import UnauthenticatedError
from lpsync.transport.auth import (
    CHALLENGE_SIZE,
    VERDICT_SIZE,
    authenticate_server_socket,
    client_handshake,
)
from tests.daemon.harness import DaemonProcess, helper_context, run_ranks
from tests.daemon.security_workers import allreduces, ucx_garbage
from tests.ports import free_ports

pytest.importorskip("ucxx")

SECRET = "hostile-test-secret"


def _spawn(target, *args, timeout: float = 60.0):
    with helper_context().Pool(1) as pool:
        return pool.apply_async(target, args).get(timeout)


def _wait_for(d: DaemonProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in d.log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in:\n{d.log.read_text()[-3000:]}"
        time.sleep(0.2)


def _garbage(port: int, rounds: int, hold: list[socket.socket]) -> None:
    """Random bytes, a fake hello and idle connections at a peer port."""
    for i in range(rounds):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            if i % 5 == 4:
                hold.append(s)  # idle: never says anything
                continue
            with s:
                s.sendall(b"LPSA\x01" + os.urandom(64) if i % 3 else os.urandom(4096))


def test_hostile_peers_are_refused_and_the_mesh_is_not_disturbed(tmp_path: Path) -> None:
    ports = free_ports(3)
    peers = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    args = ("--heartbeat-timeout", "3", "--peer-transport", "ucx")  # UCX garbage is among the attacks
    daemons: list[DaemonProcess] = []
    held: list[socket.socket] = []

    def start(name: str, *argv: str, secret: str = SECRET) -> DaemonProcess:
        (tmp_path / name).mkdir()
        d = DaemonProcess(tmp_path / name, *argv, *args, env={"LPSYNC_SECRET": secret})
        daemons.append(d)
        return d

    try:
        node0 = start("node0", "--peers", peers, "--node-rank", "0")
        # Another cluster's daemon: its --peers make our node 0 its node 0; it dials as rank 1.
        intruder = start(
            "intruder",
            "--peers",
            f"127.0.0.1:{ports[0]},127.0.0.1:{ports[2]}",
            "--node-rank",
            "1",
            secret="another-cluster-secret",
        )
        _wait_for(node0, "refused")
        _garbage(ports[0], 20, held)  # while node 0's mesh is forming
        # A UCX peer that sends garbage where the hello belongs, also while forming.
        (own,) = free_ports(1)
        outcomes = _spawn(ucx_garbage, ports[0], own, [41, 7, 300])
        assert "answered" not in outcomes, outcomes
        _wait_for(node0, "another protocol")
        node1 = start("node1", "--peers", peers, "--node-rank", "1")
        _wait_for(node0, "peer mesh up", 60)
        _wait_for(node1, "peer mesh up", 60)
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["ok"] = run_ranks(
                    4, allreduces, [node0.socket, node1.socket], 2, "hostile", 4, 40, timeout=180
                )
            except BaseException as error:  # reported below
                box["error"] = error

        runner = threading.Thread(target=job)
        runner.start()
        while runner.is_alive():  # the attack goes on for as long as the job runs
            for port in ports[:2]:
                _garbage(port, 10, held)
            time.sleep(0.2)
        runner.join()
        assert "error" not in box, box.get("error")
        assert box["ok"] == [[True] * 40] * 4
        for d in (node0, node1):
            log = d.log.read_text()
            assert log.count("peer mesh up") == 1, log[-3000:]  # never rebuilt
            assert "peer mesh lost" not in log, log[-3000:]
        assert "UnauthenticatedError" in intruder.log.read_text()
        assert "peer mesh up" not in intruder.log.read_text()
    finally:
        for s in held:
            s.close()
        rcs = [d.stop() for d in daemons]
    assert rcs[0] == 0 and rcs[2] == 0, rcs  # node 0 and node 1 stop cleanly


def _pair() -> tuple[socket.socket, socket.socket]:
    """A TCP connection on loopback (server side, client side), reads bounded by 10 s."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        server, _ = listener.accept()
    return server, client


def test_a_replayed_handshake_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Record a real client's side of a handshake, replay it on a new connection: the
    server's fresh nonce makes the recorded proof worthless."""
    secret = SECRET.encode()
    recorded: list[bytes] = []

    def serve(sock: socket.socket, out: dict[str, Any]) -> None:
        try:
            out["result"] = authenticate_server_socket(sock, secret, 0, timeout=5)
        except Exception as error:
            out["error"] = error

    a, b = _pair()
    first: dict[str, Any] = {}
    server = threading.Thread(target=serve, args=(a, first))
    server.start()

    def send(data: bytes) -> None:
        recorded.append(data)
        b.sendall(data)

    def recv(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = b.recv(size - len(data))  # bounded by the socket's timeout
            assert chunk, "the server hung up"
            data += chunk
        return data

    client_handshake(send, recv, secret, 1)
    server.join(10)
    assert first["result"].peer_rank == 1
    a.close()
    b.close()
    a, b = _pair()
    replay: dict[str, Any] = {}
    server = threading.Thread(target=serve, args=(a, replay))
    with caplog.at_level("WARNING", logger="lpsync.auth"):
        server.start()
        b.sendall(recorded[0])  # the old hello
        assert len(recv(CHALLENGE_SIZE)) == CHALLENGE_SIZE  # a fresh challenge
        b.sendall(recorded[1])  # the old proof
        assert recv(VERDICT_SIZE) == b"\x00"  # refused
        server.join(10)
    a.close()
    b.close()
    assert isinstance(replay.get("error"), UnauthenticatedError), replay
    assert any("refused" in r.getMessage() for r in caplog.records), caplog.text
