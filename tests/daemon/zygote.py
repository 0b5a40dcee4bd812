"""Daemons for the tests, forked from a process that has imported the daemon already.

A daemon started as ``python -m lpsync.cli daemon`` spends ~0.4 CPU-s importing numpy,
grpc, prometheus_client and its own modules before it serves; the suite starts a few
hundred, a large share of its CPU on two cores. This server (one per test process,
``python -m tests.daemon.zygote``) imports them once and forks a daemon per request: the
child applies the request's environment, working directory, log and lifeline, and runs
``lpsync.cli.main`` as the interpreter would, exit code and all. The daemon reads its
settings only after that (no module reads the environment at import: CONTRIBUTING.md), so
a forked daemon is configured as an exec'd one. ``LPSYNC_TEST_EXEC_DAEMONS=1`` (or
``DaemonProcess(preforked=False)``) execs each one instead.

The forked daemon is the server's child, not the test's: the server reaps it and reports
its exit code, and :class:`ForkedProcess` answers what the tests ask of a Popen (``poll``,
``wait``, ``returncode``, signals by pid)."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# What a daemon imports before it serves (and the commands' parser, built by lpsync.cli).
PRELOAD = ("lpsync.cli", "lpsync.daemon.control.server", "lpsync.daemon.control.logs")
_MAX_REQUEST = 1 << 20


# --- the server -------------------------------------------------------------------------


def _serve(requests: socket.socket, exits: socket.socket) -> dict[str, Any]:
    """Fork a daemon per request until the test process closes ``requests``; returns only
    in a forked child, with its request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through woken_w
    signal.set_wakeup_fd(woken_w)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(woken_r, selectors.EVENT_READ)
    births: dict[int, int] = {}
    born = 0
    while True:
        for key, _ in selector.select():
            if key.fileobj is requests:
                message, fds, _, _ = socket.recv_fds(requests, _MAX_REQUEST, 2)
                if not message:  # the test process is gone: so is the server
                    sys.exit(0)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    os.close(woken_r)
                    os.close(woken_w)
                    requests.close()
                    exits.close()
                    request["fds"] = fds
                    return request
                for fd in fds:
                    os.close(fd)
                born += 1  # a pid can come back: its exit is told apart by its birth
                births[pid] = born
                requests.sendall(f"{pid} {born}".encode())
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(woken_r, 4096)
        while True:  # reap every child that has ended and report its exit code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            exits.sendall(f"{pid} {births.pop(pid, 0)} {os.waitstatus_to_exitcode(status)}".encode())


def _become_daemon(request: dict[str, Any]) -> int:
    """In the forked child: the request's session, log, lifeline, directory and
    environment; then the daemon's command line, as ``python -m lpsync.cli`` runs it."""
    lifeline, log = request["fds"][0], (request["fds"][1] if request["log"] else None)
    if request["new_session"]:
        os.setsid()
    if log is not None:
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    argv = list(request["argv"])
    argv[argv.index("--lifeline-fd") + 1] = str(lifeline)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from lpsync import cli

    sys.argv = [cli.__file__, *argv]
    return cli.main(argv)


def main() -> None:
    requests = socket.socket(fileno=int(sys.argv[1]))
    exits = socket.socket(fileno=int(sys.argv[2]))
    request = _serve(requests, exits)
    sys.exit(_become_daemon(request))  # only a forked daemon gets here


# --- the test process's side ---------------------------------------------------------------


class _Server:
    """This process's zygote: started on first use, stopped when this process exits (its
    end of the request socket closes)."""

    def __init__(self) -> None:
        self._requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._exits, their_exits = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.daemon.zygote", str(theirs.fileno()), str(their_exits.fileno())],
            pass_fds=(theirs.fileno(), their_exits.fileno()),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        their_exits.close()
        self._lock = threading.Lock()
        self._ended: dict[tuple[int, int], int] = {}  # (pid, birth): exit code
        self._changed = threading.Condition()
        self.gone = False
        threading.Thread(target=self._read_exits, name="zygote-exits", daemon=True).start()

    def fork(self, argv: Sequence[str], fds: Sequence[int], **request: Any) -> tuple[int, int]:
        """The forked daemon's pid and birth (the server's count of its forks)."""
        payload = json.dumps({"argv": list(argv), **request}).encode()
        with self._lock:
            socket.send_fds(self._requests, [payload], list(fds))
            reply = self._requests.recv(64)
        if not reply:
            raise RuntimeError(f"the daemon zygote exited ({self.proc.poll()})")
        pid, born = reply.split()
        return int(pid), int(born)

    def _read_exits(self) -> None:
        while message := self._exits.recv(64):
            pid, born, code = map(int, message.split())
            with self._changed:
                self._ended[(pid, born)] = code
                self._changed.notify_all()
        with self._changed:
            self.gone = True
            self._changed.notify_all()

    def exit_code(self, child: tuple[int, int], timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while child not in self._ended and not self.gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._ended.pop(child, None)


_SERVER: _Server | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.gone or _SERVER.proc.poll() is not None:
            _SERVER = _Server()
        return _SERVER


class ForkedProcess:
    """A daemon forked by the zygote, with the part of Popen's interface the tests use."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        lifeline: int,
        log: int | None,
        env: Mapping[str, str],
        cwd: str | Path,
        new_session: bool,
    ) -> None:
        self.args = list(argv)
        self._server = _server()
        module = self.args.index("lpsync.cli")  # [python, -m, lpsync.cli, daemon, ...]
        self._child = self._server.fork(
            self.args[module + 1 :],
            [lifeline] if log is None else [lifeline, log],
            log=log is not None,
            env=dict(env),
            cwd=str(cwd),
            new_session=new_session,
        )
        self.pid = self._child[0]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._child, timeout)
            if self.returncode is None and self._server.gone and not _running(self.pid):
                self.returncode = -signal.SIGKILL  # the zygote died: the code is lost
        if self.returncode is None and timeout:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


if __name__ == "__main__":
    main()
