"""Start daemons and client processes for the tests; no mocks of the daemon or gRPC."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


class DaemonProcess:
    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None,
                 wrap: tuple[str, ...] = ()) -> None:
        """``wrap``: a command prefix that execs the daemon (``ip netns exec NS``)."""
        self.socket = str(tmp / "lpsync.sock")
        self.log = tmp / f"daemon-{time.monotonic_ns()}.log"
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "lpsync.cli", "daemon", "--socket", self.socket,
             "--log-level", "DEBUG", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        deadline = time.monotonic() + 20
        while not serving(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"daemon did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise
        finally:
            self._log.close()
        return rc

    def stop_and_check(self) -> None:
        rc = self.stop()
        leaked = shm_segments(self.pid)
        assert rc == 0, f"daemon exited with {rc}:\n{self.log.read_text()[-4000:]}"
        assert not leaked, f"shared memory left behind: {leaked}"
        assert not Path(self.socket).exists(), "socket left behind"
        assert not Path(self.socket + ".trigger").exists(), "trigger socket left behind"


def serving(socket: str) -> bool:
    if not Path(socket).exists():
        return False
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def shm_segments(pid: int | None = None) -> list[str]:
    prefix = "lpsync-" if pid is None else f"lpsync-{pid}-"
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


def _entry(target, queue, rank, args):
    try:
        queue.put((rank, "ok", target(rank, *args)))
    except BaseException as error:  # reported to the test, which fails with it
        import traceback

        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_ranks(world: int, target, *args, timeout: float = 90.0, dies: tuple[int, ...] = ()
              ) -> list:
    """Run ``target(rank, *args)`` in ``world`` spawned processes; their return values by rank
    (None for the ranks in ``dies``, which are expected to kill themselves unreported).

    Raises AssertionError with the child's traceback if one fails, and kills stragglers.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, queue, r, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world - len(dies):
            rank, kind, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if kind == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not errors, "\n".join(errors)
    return [results.get(r) for r in range(world)]
