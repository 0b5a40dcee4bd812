"""Daemons and trainers on an emulated cluster, for the chaos run and the clean-exit
measurement: one daemon per node (in its namespace, started through lpsync.daemon.launch),
trainer processes beside them (Unix sockets reach across namespaces), and the checks
that a stop left nothing behind (shared memory, sockets, processes)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from lpsync.cluster import ClusterSpec
from lpsync.daemon import launch

PEER_PORT = 13337


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie counts: its parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shm_segments(pid: int) -> list[str]:
    """The shared-memory segments daemon ``pid`` made (named lpsync-<pid>-*)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"lpsync-{pid}-*"))


@dataclass
class Exit:
    """How one daemon ended after SIGTERM."""

    node: int
    seconds: float  # from SIGTERM to exit; inf if it had to be killed
    code: int | None
    shm: list[str]
    sockets: list[str]

    @property
    def clean(self) -> bool:
        return self.code == 0 and not self.shm and not self.sockets


@dataclass
class Nodes:
    """One daemon per node of ``spec`` (``transport``: ucx or tcp), logs and sockets in ``tmp``."""

    spec: ClusterSpec
    tmp: Path
    transport: str
    heartbeat_timeout: float = 2.0
    flags: tuple[str, ...] = ()
    daemons: list[launch.Daemon | None] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)  # pids we SIGKILLed: their shm is ours to reclaim
    _env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._env = {
            **launch.clean_env(),
            "LPSYNC_SECRET": secrets.token_hex(16),
            "LPSYNC_UCX_TLS": "tcp",
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        self.daemons = [None] * self.spec.nodes

    def socket(self, node: int) -> str:
        return str(self.tmp / f"node{node}" / "lpsync.sock")

    def start(self, node: int, wait: bool = True) -> launch.Daemon:
        where = self.tmp / f"node{node}"
        where.mkdir(exist_ok=True)
        peers = ",".join(f"{self.spec.address(i)}:{PEER_PORT}" for i in range(self.spec.nodes))
        daemon = launch.Daemon(
            self.socket(node),
            "--node-rank",
            str(node),
            "--peers",
            peers,
            "--peer-transport",
            self.transport,
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            "--heartbeat-interval",
            str(self.heartbeat_timeout / 4),
            *self.flags,
            log=where / f"daemon-{time.monotonic_ns()}.log",
            env=self._env,
            wrap=("ip", "netns", "exec", self.spec.namespace(node)),
            start_new_session=True,  # Ctrl-C reaches us only; we stop them in order
            start_timeout=60.0,
            wait=wait,
        )
        self.daemons[node] = daemon
        return daemon

    def start_all(self) -> None:
        for node in range(self.spec.nodes):
            self.start(node, wait=False)
        deadline = time.monotonic() + 60.0 + 2.0 * self.spec.nodes
        for daemon in self.daemons:
            assert daemon is not None
            daemon.wait_serving(deadline)

    def kill(self, node: int) -> None:
        daemon = self.daemons[node]
        if daemon is not None and daemon.alive():
            self.killed.append(daemon.pid)
            daemon.kill()

    def signal(self, node: int, signum: int) -> None:
        daemon = self.daemons[node]
        if daemon is not None and daemon.alive():
            with contextlib.suppress(ProcessLookupError):
                daemon.proc.send_signal(signum)

    def stop_all(self, bound: float = 20.0) -> list[Exit]:
        """SIGTERM every daemon at once (after SIGCONT: a frozen one must hear it); how each
        exited, each timed on a thread of its own. One that outlives ``bound`` is killed
        and reported with seconds = inf."""
        live = [(n, d) for n, d in enumerate(self.daemons) if d is not None and d.alive()]
        exits: list[Exit] = []
        waiters = [threading.Thread(target=self._stop_one, args=(n, d, bound, exits)) for n, d in live]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        return sorted(exits, key=lambda e: e.node)

    def _stop_one(self, node: int, daemon: launch.Daemon, bound: float, exits: list[Exit]) -> None:
        daemon.proc.send_signal(signal.SIGCONT)
        at = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = daemon.proc.wait(bound)
            seconds = time.monotonic() - at
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):  # where it hangs, into its log
                daemon.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            daemon.kill()
            self.killed.append(daemon.pid)
            code, seconds = None, float("inf")
        daemon.kill()  # closes its log
        left = [s for s in (daemon.socket, daemon.socket + ".trigger") if Path(s).exists()]
        exits.append(Exit(node, seconds, code, shm_segments(daemon.pid), left))

    def reclaim(self) -> int:
        """Unlink what the daemons we SIGKILLed left in /dev/shm (a killed process cannot
        clean up); the number of segments removed."""
        removed = 0
        for pid in self.killed:
            for name in shm_segments(pid):
                Path("/dev/shm", name).unlink(missing_ok=True)
                removed += 1
        return removed

    def tail(self, node: int, lines: int = 30) -> str:
        daemon = self.daemons[node]
        return daemon.tail(lines) if daemon is not None else ""


class Trainer:
    """A lpsync.chaos.trainer process; its reports go to ``sink`` as dicts."""

    def __init__(
        self, socket: str, rank: int, world: int, per_node: int, timeout: float, sink: queue.Queue[Any]
    ) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lpsync.chaos.trainer",
                socket,
                str(rank),
                str(world),
                str(per_node),
                str(timeout),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**launch.clean_env(), "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout, sink), daemon=True)
        self._reader.start()

    def _read(self, stdout: TextIO, sink: queue.Queue[Any]) -> None:
        for line in stdout:  # blocks; ends when the process does
            with contextlib.suppress(ValueError):
                sink.put(json.loads(line))

    def epoch(self, epoch: int) -> None:
        with contextlib.suppress(OSError, ValueError):  # a dead trainer is restarted later
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{epoch}\n")
            self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close_input(self) -> None:
        """Close its stdin: it finishes its collective and exits. Close every trainer's
        before waiting for any: one left running would wait, in its next collective, for
        the ranks that left until its timeout."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def stop(self, grace: float = 10.0) -> int | None:
        """Close its stdin (it finishes its collective and exits), then kill if need be."""
        self.close_input()
        self.proc.send_signal(signal.SIGCONT)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None
        finally:
            self._reader.join(5)
