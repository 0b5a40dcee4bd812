"""One way to start and probe a daemon process: spawn it, wait until it serves, read its
health and status, stop it. The demo, the benchmarks, ``lpsync health``/``status`` and
the test harness all use this module (a second copy drifts: another timeout, another
probe, another way to find out why a daemon did not come up).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from lpsync.errors import LpsyncError

START_TIMEOUT = 30.0  # seconds for a daemon to serve after its process started


class Process(Protocol):
    """What this module asks of a daemon's process: a Popen, or what Daemon._spawn returns."""

    pid: int
    returncode: int | None
    args: Any

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class DaemonStartError(LpsyncError):
    """A daemon process exited or did not serve in time; the message has its log's end."""


def health(socket: str, timeout: float = 1.0) -> str:
    """The daemon's overall gRPC health status name (SERVING, NOT_SERVING, ...); raises
    grpc.RpcError when nothing answers on ``socket``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def serving(socket: str, timeout: float = 1.0) -> bool:
    """Whether a daemon serves on ``socket`` now."""
    import grpc

    if not Path(socket).exists():
        return False
    try:
        return health(socket, timeout) == "SERVING"
    except grpc.RpcError:
        return False


def status(socket: str, recent: int = 20, token: str = "", timeout: float = 5.0, history: int = 0) -> Any:
    """The daemon's StatusResponse (sessions, jobs, the flight recorder)."""
    import grpc

    from lpsync_client.wire.proto import lpsync_pb2 as pb
    from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        return pb_grpc.LpSyncStub(channel).Status(
            pb.StatusRequest(recent=recent, history=history), timeout=timeout, metadata=metadata
        )


def command(socket: str, *flags: str) -> list[str]:
    """The command line of a daemon serving ``socket`` (this interpreter, this lpsync)."""
    return [sys.executable, "-m", "lpsync.cli", "daemon", "--socket", socket, *flags]


class Daemon:
    """One daemon process: started at once, serving when the constructor returns.

    ``log``: its stdout and stderr go there (else they are inherited); ``wrap``: a command
    prefix that execs it (``ip netns exec NS``); ``start_new_session``: keep the terminal's
    Ctrl-C from reaching it (the caller stops it in order).

    The daemon stops by itself when this process is gone, however it ends (a SIGKILL, a
    crash): it holds the read end of a pipe whose only write end stays here
    (``--lifeline-fd``), and the end of that pipe stops it as SIGTERM would. Without it a
    killed demo, benchmark or test left its daemons running with their sockets and
    shared memory. A child forked from this process closes its copy of the write end
    (``_forget_lifelines_in_child``), so the daemon does not wait for it too."""

    def __init__(
        self,
        socket: str,
        *flags: str,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
        cwd: str | Path | None = None,
        start_new_session: bool = False,
        start_timeout: float = START_TIMEOUT,
        wait: bool = True,
    ) -> None:
        self.socket, self.log = socket, log
        self._log: IO[str] | None = open(log, "w") if log is not None else None  # noqa: SIM115 - closed in stop()
        lifeline, self._lifeline = os.pipe()  # the write end: closed by _close_files (stop, kill)
        _WITH_LIFELINES.add(self)
        try:
            self.proc: Process = self._spawn(
                [*wrap, *command(socket, "--lifeline-fd", str(lifeline), *flags)],
                lifeline=lifeline,
                env=env,
                cwd=cwd,
                start_new_session=start_new_session,
            )
        except BaseException:
            self._close_files()
            raise
        finally:
            os.close(lifeline)
        self.pid = self.proc.pid
        if wait:
            try:
                self.wait_serving(time.monotonic() + start_timeout)
            except BaseException:
                self.kill()
                raise

    def _spawn(
        self,
        argv: list[str],
        *,
        lifeline: int,
        env: Mapping[str, str] | None,
        cwd: str | Path | None,
        start_new_session: bool,
    ) -> Process:
        """Start the daemon's process (a Popen, or an object with Popen's pid, returncode,
        poll, wait, send_signal and kill; the test harness forks daemons from a preloaded
        process this way). ``lifeline``: the pipe's read end that ``argv`` names."""
        return subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=start_new_session,
            pass_fds=(lifeline,),
        )

    def wait_serving(self, deadline: float) -> None:
        """Return once the daemon serves; DaemonStartError if it exits or ``deadline`` passes."""
        while not serving(self.socket):
            if self.proc.poll() is not None:
                raise DaemonStartError(
                    f"the daemon exited ({self.proc.returncode}) before serving:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise DaemonStartError(f"the daemon did not serve on {self.socket} in time:\n{self.tail()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return not reaped(self.proc)

    def tail(self, lines: int = 40) -> str:
        """The end of the daemon's log (empty without one)."""
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait for the exit (SIGKILL if it does not come: TimeoutExpired)."""
        if not reaped(self.proc):
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float = 20.0) -> int:
        """Wait for the exit of a daemon already told to stop (SIGKILL if it does not
        come: TimeoutExpired); signals nothing itself (stop_together signals them all)."""
        try:
            if not wait_reaped(self.proc, timeout):
                self.kill()
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            assert self.proc.returncode is not None
            return self.proc.returncode
        finally:
            self._close_files()

    def kill(self) -> None:
        if not reaped(self.proc):
            self.proc.kill()
        wait_reaped(self.proc, 5)  # an unkillable process: move on
        self._close_files()

    def _close_files(self) -> None:
        self._forget_lifeline()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _forget_lifeline(self) -> None:
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        _WITH_LIFELINES.discard(self)


# The daemons whose lifeline's write end this process holds. A forked child (a
# multiprocessing "fork" worker, a test's os.fork) gets copies of every descriptor; its
# copies would keep those daemons up until the child exits, however long after their
# launcher is gone.
_WITH_LIFELINES: weakref.WeakSet[Daemon] = weakref.WeakSet()


def _forget_lifelines_in_child() -> None:
    """In a forked child: close its copies of the write ends and forget them, so that a
    later stop() there closes nothing that reuses the numbers."""
    for daemon in list(_WITH_LIFELINES):
        daemon._forget_lifeline()


os.register_at_fork(after_in_child=_forget_lifelines_in_child)


def stop_together(daemons: Sequence[Daemon], timeout: float = 20.0) -> list[int | str]:
    """Stop ``daemons`` as a cluster stops: SIGTERM to every live one first, then each
    awaited (Daemon.wait_stopped). One by one, each would wait out its bounded wait for
    the goodbyes of peers still running. Each one's exit code, or why it was killed."""
    for daemon in daemons:
        if daemon.alive():
            daemon.proc.send_signal(signal.SIGTERM)
    codes: list[int | str] = []
    for daemon in daemons:
        try:
            codes.append(daemon.wait_stopped(timeout))
        except subprocess.TimeoutExpired as error:  # killed by wait_stopped()
            codes.append(repr(error))
    return codes


def reaped(proc: Process) -> bool:
    """Whether ``proc`` has ended (reaped here if so), without Popen's wait lock: a Ctrl-C
    that lands inside Popen.wait or poll just after the lock is taken leaves it held for
    good (CPython's subprocess takes it outside its try), and every later wait or poll
    then reports a dead process as running."""
    if proc.returncode is not None:
        return True
    if not isinstance(proc, subprocess.Popen):  # not this process's child (Daemon._spawn)
        return proc.poll() is not None
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped already
        return True
    if pid == 0:
        return False
    proc.returncode = os.waitstatus_to_exitcode(status)
    return True


def wait_reaped(proc: Process, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to end (reaped, lock-free); whether it did."""
    deadline = time.monotonic() + timeout
    while not reaped(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # a stopping process, checked 20 times a second: a sleep, not a spin
    return True


def clean_env() -> dict[str, str]:
    """This environment without the user's LPSYNC_* settings (a socket, a secret)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LPSYNC_")}
