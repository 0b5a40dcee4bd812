"""Daemons on this machine joined as a multi-node cluster over loopback: one per "node",
each with its socket, its peer port and its metrics port, sharing a fresh cluster secret
(in a 0600 file; never on a command line). Stopped, sockets and secret removed, on exit."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from lpsync.daemon import launch
from lpsync.daemon.launch import clean_env
from lpsync.errors import LpsyncError
from lpsync.transport.ports import free_ports

_START_TIMEOUT = 60.0


class DemoError(LpsyncError):
    """The demo could not run (a daemon or trainer failed); the message says which."""


@dataclass
class Node:
    rank: int
    daemon: launch.Daemon
    metrics_port: int

    @property
    def socket(self) -> str:
        return self.daemon.socket

    @property
    def log(self) -> Path:
        assert self.daemon.log is not None
        return self.daemon.log

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class LocalCluster:
    """``nodes`` daemons in ``where`` (a private directory the caller removes), each
    started with the flags ``extra`` too (``--devices ...``)."""

    def __init__(self, where: Path, nodes: int, extra: tuple[str, ...] = ()) -> None:
        self.where, self.nodes = where, []
        peer_ports = free_ports(2 * nodes)
        peers = ",".join(f"127.0.0.1:{p}" for p in peer_ports[:nodes])
        secret_file = where / "cluster.secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32))
        try:
            for rank in range(nodes):
                flags: tuple[str, ...]
                flags = ("--node-rank", str(rank), "--peers", peers, "--secret-file", str(secret_file))
                flags += ("--metrics-port", str(peer_ports[nodes + rank]), "--log-level", "WARNING", *extra)
                # Started together, waited for below (they mesh with each other); in a
                # session of their own: Ctrl-C reaches us only, and we stop them in order.
                daemon = launch.Daemon(
                    str(where / f"node{rank}.sock"),
                    *flags,
                    log=where / f"node{rank}.log",
                    env=clean_env(),
                    start_new_session=True,
                    wait=False,
                )
                self.nodes.append(Node(rank, daemon, peer_ports[nodes + rank]))
            deadline = time.monotonic() + _START_TIMEOUT
            for node in self.nodes:
                try:
                    node.daemon.wait_serving(deadline)
                except launch.DaemonStartError as error:
                    raise DemoError(f"node {node.rank}: {error}") from None
        except BaseException:
            self.stop()
            raise

    def check(self) -> None:
        """Raise if a daemon has died."""
        for node in self.nodes:
            if not node.daemon.alive():
                code, log = node.daemon.proc.returncode, node.daemon.tail()
                raise DemoError(f"the daemon of node {node.rank} exited ({code}):\n{log}")

    def stop(self) -> None:
        launch.stop_together([node.daemon for node in self.nodes], 30)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
