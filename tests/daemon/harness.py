"""Start daemons and client processes for the tests; no mocks of the daemon or gRPC."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lpsync.daemon import launch
from lpsync.transport.ports import free_ports
from tests.daemon import zygote

ROOT = Path(__file__).resolve().parents[2]


START_TIMEOUT = 20.0  # seconds for a test's daemon to serve
_AT_EXEC = ("PYTHON", "LD_", "MALLOC_")  # environment read when a process starts, not after


class DaemonProcess(launch.Daemon):
    """A daemon for a test: its own socket in ``tmp``, a DEBUG log there, the repository as
    its working directory. ``wrap``: a command prefix that execs it (``ip netns exec NS``).

    It is forked from a process that imported the daemon already (tests/daemon/zygote.py:
    ~0.4 CPU-s less per daemon); ``preforked=False`` (or LPSYNC_TEST_EXEC_DAEMONS=1) execs
    ``python -m lpsync.cli daemon`` instead, where the test is about the process itself
    (its command line, Popen's own wait). A wrapped daemon is always exec'd, and so is one
    whose ``env`` sets what only an interpreter's start reads (PYTHONPATH with a
    sitecustomize, LD_PRELOAD)."""

    def __init__(
        self,
        tmp: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        wrap: tuple[str, ...] = (),
        wait: bool = True,
        preforked: bool = True,
    ) -> None:
        self._preforked = (
            preforked
            and not wrap
            and not os.environ.get("LPSYNC_TEST_EXEC_DAEMONS")
            and not any(name.startswith(_AT_EXEC) for name in env or {})
        )
        super().__init__(
            str(tmp / "lpsync.sock"),
            "--log-level",
            "DEBUG",
            *extra,
            log=tmp / f"daemon-{time.monotonic_ns()}.log",
            env={**os.environ, **(env or {})},
            wrap=wrap,
            cwd=ROOT,
            start_timeout=START_TIMEOUT,
            wait=wait,
        )

    def _spawn(self, argv: list[str], *, lifeline: int, env, cwd, start_new_session: bool) -> launch.Process:
        if not self._preforked:
            spawn = super()._spawn
            return spawn(argv, lifeline=lifeline, env=env, cwd=cwd, start_new_session=start_new_session)
        return zygote.ForkedProcess(
            argv,
            lifeline=lifeline,
            log=self._log.fileno() if self._log is not None else None,
            env=env or os.environ,
            cwd=cwd or os.getcwd(),
            new_session=start_new_session,
        )

    def stop_and_check(self) -> None:
        rc = self.stop()
        leaked = shm_segments(self.pid)
        assert self.log is not None
        assert rc == 0, f"daemon exited with {rc}:\n{self.log.read_text()[-4000:]}"
        assert not leaked, f"shared memory left behind: {leaked}"
        assert not Path(self.socket).exists(), "socket left behind"
        assert not Path(self.socket + ".trigger").exists(), "trigger socket left behind"


def cli_status(socket: str, *args: str) -> str:
    """What `lpsync status --socket SOCKET ARGS` prints (it must succeed)."""
    return subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "status", "--socket", socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=True,
    ).stdout


def shm_segments(pid: int | None = None) -> list[str]:
    prefix = "lpsync-" if pid is None else f"lpsync-{pid}-"
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


# Client processes fork from a server that imported what they all import (numpy, the
# client, torch): each starts in milliseconds instead of a fresh interpreter's second or
# two of imports, which was a large share of the suite's CPU on 2 cores. The server only
# imports (no threads, no channels), so forking from it is safe; each child takes the
# test's environment and working directory as a spawned one would.
# torch's distributed pieces too: DDP's or FSDP's first use imports ~800 more modules
# (DTensor, dynamo, sympy), ~1.8 CPU-s in every rank that trains.
_PRELOAD = [
    "numpy",
    "grpc",
    "lpsync_client.client",
    "torch",
    "lpsync_client.torch",
    "torch.nn.parallel",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch._dynamo",
    "tests.daemon.harness",
]


@functools.cache
def helper_context() -> mp.context.BaseContext:
    """Where run_ranks and the tests start processes of their own (Process, Pool, Event,
    Queue): forked from a server that has numpy, grpc, the client and torch imported (a
    spawned interpreter cost ~0.4 CPU-s each, 76 helpers a run), or spawned under
    LPSYNC_TEST_SPAWN. A child starts with the server's environment and working directory
    (the test's when the server started): run_ranks hands its ranks the test's current
    ones; a helper gets what a test set since explicitly."""
    if os.environ.get("LPSYNC_TEST_SPAWN"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_STACKS = []  # the file a hanging rank writes its stacks to, kept open for faulthandler


def _entry(target, queue, rank, args, env=None, cwd=None, stacks=None):
    faulthandler.enable()  # a rank that crashes leaves its stacks in the test's stderr
    if stacks is not None:  # and one that hangs, when asked (run_ranks: _stacks_of)
        _STACKS.append(open(stacks, "w"))  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signal.SIGUSR1, file=_STACKS[-1], all_threads=True)
    if env is not None:  # as the test had it when it started this process
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    try:
        queue.put((rank, "ok", target(rank, *args)))
    except BaseException as error:  # reported to the test, which fails with it
        import traceback

        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def _settled(queue) -> bool:
    """True when nothing more is in flight from ranks that have exited (their last put could
    still be in the pipe when the exit code was read)."""
    time.sleep(0.2)
    return queue.empty()


def run_ranks(world: int, target, *args, timeout: float = 90.0, dies: tuple[int, ...] = ()) -> list:
    """Run ``target(rank, *args)`` in ``world`` spawned processes; their return values by rank
    (None for the ranks in ``dies``, which are expected to kill themselves unreported).

    Raises AssertionError with the child's traceback if one fails, and kills stragglers.
    """
    ctx = helper_context()
    queue = ctx.Queue()
    env, cwd = dict(os.environ), os.getcwd()
    stacks = tempfile.mkdtemp(prefix="lpsync-ranks-")
    procs = [
        ctx.Process(target=_entry, args=(target, queue, r, args, env, cwd, f"{stacks}/{r}"))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world - len(dies):
            try:
                rank, kind, value = queue.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue_module.Empty:
                # A rank that died without a word (a crash, a signal) fails the test now, with
                # its exit code, instead of leaving the others waiting for it until the timeout.
                waiting = set(range(world)) - reported - set(dies)
                gone = [r for r in sorted(waiting) if procs[r].exitcode is not None]
                if gone and not _settled(queue):
                    continue
                if gone:
                    errors += [f"rank {r}: exited with code {procs[r].exitcode}, unreported" for r in gone]
                    break
                if time.monotonic() >= deadline:
                    errors.append(f"ranks {sorted(waiting)} did not report within {timeout} s")
                    break
                continue
            reported.add(rank)
            if kind == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        if len(reported) < world - len(dies):  # gave up on someone: the rest get 5 s
            deadline = min(deadline, time.monotonic() + 5)
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                errors.append(_stacks_of(procs.index(p), p, f"{stacks}/{procs.index(p)}"))
                p.kill()
                p.join(5)
        shutil.rmtree(stacks, ignore_errors=True)
    assert not errors, "\n".join(errors)
    return [results.get(r) for r in range(world)]


def _stacks_of(rank: int, proc, path: str) -> str:
    """Every thread's stack of a rank about to be killed for hanging (faulthandler,
    registered in _entry), for the test's failure message."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
    try:
        with open(path) as f:
            return f"rank {rank}, hanging, was at:\n{f.read()}"
    except OSError as error:
        return f"rank {rank}, hanging: no stacks ({error})"


class PeeredDaemons:
    """``nodes`` daemons on loopback joined by the peer plane (--peers, a shared
    secret unless ``secrets`` gives one per node), each started with ``extra`` flags."""

    def __init__(
        self,
        tmp: Path,
        nodes: int,
        *extra: str,
        secrets: list[str] | None = None,
        per_node: list[tuple[str, ...]] | None = None,
        env_of: list[dict[str, str]] | None = None,
        wrap_of: list[tuple[str, ...]] | None = None,
    ) -> None:
        self.tmp, self.nodes, self.extra = tmp, nodes, extra
        self.per_node = per_node or [()] * nodes  # more flags, node by node
        self.env_of = env_of or [{}] * nodes  # more environment, node by node
        self.wrap_of = wrap_of or [()] * nodes  # a command prefix, node by node
        self.peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(nodes))
        self.secrets = secrets or ["harness-cluster-secret"] * nodes
        self.daemons: list[DaemonProcess | None] = [None] * nodes
        # Started together, then awaited: each one's start-up overlaps the others'.
        started = [self.start(node, wait=False) for node in range(nodes)]
        try:
            deadline = time.monotonic() + START_TIMEOUT
            for daemon in started:
                daemon.wait_serving(deadline)
        except BaseException:
            for daemon in started:
                daemon.kill()
            raise

    def start(self, node: int, wait: bool = True) -> DaemonProcess:
        where = self.tmp / f"node{node}"
        where.mkdir(exist_ok=True)
        self.daemons[node] = DaemonProcess(
            where,
            "--peers",
            self.peers,
            "--node-rank",
            str(node),
            *self.extra,
            *self.per_node[node],
            env={"LPSYNC_SECRET": self.secrets[node], **self.env_of[node]},
            wrap=self.wrap_of[node],
            wait=wait,
        )
        return self.daemons[node]

    @property
    def sockets(self) -> list[str]:
        return [d.socket for d in self.daemons if d is not None]

    def log(self, node: int) -> str:
        daemon = self.daemons[node]
        return daemon.log.read_text() if daemon is not None else ""

    def stop(self) -> list[str]:
        """Stop every daemon; the failures of those that did not exit cleanly (0)."""
        live = [(node, d) for node, d in enumerate(self.daemons) if d is not None]
        # Stopped on the way out of a failing test: every thread's stack into the logs, for
        # the post-mortem. Only then: a dump races the daemon's running threads, and one
        # UCX daemon died of SIGSEGV in the middle of its dump (2026-12-07).
        if sys.exc_info()[0] is not None:
            for _, daemon in live:
                if daemon.proc.poll() is None:
                    daemon.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.05)  # delivered before the SIGTERM that follows (a lower signal number)
        killed = [daemon.proc.poll() == -signal.SIGKILL for _, daemon in live]  # by a test, on purpose
        codes = launch.stop_together([daemon for _, daemon in live])
        unclean = [
            f"node {node} exited with {rc}:\n{daemon.log.read_text()[-3000:]}"
            for (node, daemon), rc, dead in zip(live, codes, killed, strict=True)
            if rc != 0 and not dead
        ]
        _reclaim(self)
        return unclean

    def stop_and_check(self) -> None:
        unclean = self.stop()
        assert not unclean, "\n".join(unclean)


def _reclaim(c: PeeredDaemons) -> None:
    """Unlink what a daemon we killed left in /dev/shm; a daemon that stopped cleanly must
    have left nothing."""
    for daemon in c.daemons:
        if daemon is None:
            continue
        left = shm_segments(daemon.pid)
        if daemon.proc.returncode is not None and daemon.proc.returncode < 0:
            for name in left:
                Path("/dev/shm", name).unlink(missing_ok=True)
        else:
            assert not left, left


class MemoryPeak:
    """The most ``field`` (a /proc/PID/status line: RssAnon, VmRSS) each of ``pids`` grew
    by, in KiB, while the ``with`` block ran: sampled every 10 ms from a thread (the
    kernel keeps no per-field peak)."""

    def __init__(self, pids: list[int], field: str) -> None:
        self.pids, self.field = pids, field
        self.base = [self._read(pid) for pid in pids]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _read(self, pid: int) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{self.field}:"):
                return int(line.split()[1])
        raise LookupError(f"no {self.field} in /proc/{pid}/status")

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            for i, pid in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], self._read(pid))

    @property
    def growth_kib(self) -> list[int]:
        return [top - base for top, base in zip(self.peak, self.base, strict=True)]

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
