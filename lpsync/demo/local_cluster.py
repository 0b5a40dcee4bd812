"""Daemons on this machine joined as a multi-node cluster over loopback: one per "node",
each with its socket, its peer port and its metrics port, sharing a fresh cluster secret
(in a 0600 file; never on a command line). Stopped, sockets and secret removed, on exit."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lpsync.bench.runner import serving
from lpsync.errors import LpsyncError
from lpsync.transport.ports import free_ports

_START_TIMEOUT = 60.0


class DemoError(LpsyncError):
    """The demo could not run (a daemon or trainer failed); the message says which."""


def clean_env() -> dict[str, str]:
    """The environment without the user's LPSYNC_* settings (a socket, a secret)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LPSYNC_")}


@dataclass
class Node:
    rank: int
    socket: str
    metrics_port: int
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class LocalCluster:
    """``nodes`` daemons in ``where`` (a private directory the caller removes)."""

    def __init__(self, where: Path, nodes: int) -> None:
        self.where, self.nodes = where, []
        peer_ports = free_ports(2 * nodes)
        peers = ",".join(f"127.0.0.1:{p}" for p in peer_ports[:nodes])
        secret_file = where / "cluster.secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32))
        try:
            for rank in range(nodes):
                sock, log = where / f"node{rank}.sock", where / f"node{rank}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "lpsync.cli",
                            "daemon",
                            "--socket",
                            str(sock),
                            "--node-rank",
                            str(rank),
                            "--peers",
                            peers,
                            "--secret-file",
                            str(secret_file),
                            "--metrics-port",
                            str(peer_ports[nodes + rank]),
                            "--log-level",
                            "WARNING",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=clean_env(),
                        start_new_session=True,
                    )  # Ctrl-C reaches us only; we stop them in order
                self.nodes.append(Node(rank, str(sock), peer_ports[nodes + rank], log, proc))
            deadline = time.monotonic() + _START_TIMEOUT
            for node in self.nodes:
                while not serving(node.socket):
                    if node.proc.poll() is not None or time.monotonic() > deadline:
                        raise DemoError(f"the daemon of node {node.rank} did not start:\n{tail(node.log)}")
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def check(self) -> None:
        """Raise if a daemon has died."""
        for node in self.nodes:
            if node.proc.poll() is not None:
                raise DemoError(
                    f"the daemon of node {node.rank} exited ({node.proc.returncode}):\n{tail(node.log)}"
                )

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.proc.wait(30)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(10)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
