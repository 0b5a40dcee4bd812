"""Is the daemon still responsive under load? Health-check latency while it is flooded with
bad requests, runs a 256 MiB allreduce, and holds a stalled collective; then SIGTERM.

    python -m lab.responsive [--seconds 5] [--flooders 4] [--mib 256] [--json]

Set up: a daemon of its own (Unix socket in a temporary directory). Each scenario runs for
``--seconds`` while this process checks health every 10 ms over a fresh channel per check
(what a kubelet probe does) and calls Status (what ``lpsync status`` does) every 250 ms.
Scenarios: idle; flood (``--flooders`` processes sending undecodable bytes, absurd Attach
requests, NaN timeouts and garbage Session streams as fast as they can); big (2 ranks
looping a ``--mib`` MiB float32 allreduce with a small one of the same job right behind it,
results checked); direct (the same with
``algorithm="direct"``: one thread reduces it all, which must not be the event loop);
stalled (rank 0 of a 2-rank job waits in an allreduce rank 1 never joins); all (flood, big
and stalled at once). At the end of "all",
SIGTERM: the time until the daemon has exited. Reported: median, p99 and max latency.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lpsync.bench.runner import percentile
from lpsync.daemon import launch
from lpsync.daemon.launch import serving

SCENARIOS = ("idle", "flood", "big", "direct", "stalled", "all")


@dataclass
class Result:
    scenario: str
    health: list[float] = field(default_factory=list)  # seconds per check
    status: list[float] = field(default_factory=list)  # seconds per Status call
    failures: int = 0  # checks that did not answer SERVING within 5 s
    big_iterations: int = 0  # big allreduces completed (and checked) while sampling

    def summary(self) -> dict:
        return {
            "scenario": self.scenario,
            "checks": len(self.health),
            "health_median_ms": _pct(self.health, 50) * 1e3,
            "health_p99_ms": _pct(self.health, 99) * 1e3,
            "health_max_ms": max(self.health, default=0.0) * 1e3,
            "status_median_ms": _pct(self.status, 50) * 1e3,
            "status_max_ms": max(self.status, default=0.0) * 1e3,
            "failures": self.failures,
            "big_iterations": self.big_iterations,
        }


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else 0.0


# -- load generators (spawned processes; module level so that spawn can import them) ------
def flood(socket: str, stop) -> None:
    import grpc

    from lpsync_client.wire.proto import lpsync_pb2 as pb

    bad = [
        ("Attach", b"\xff\xff\xff\xff"),
        ("Attach", pb.AttachRequest(job="flood", world_size=1 << 31).SerializeToString()),
        (
            "Collective",
            pb.CollectiveRequest(session_id="x", op="allreduce", timeout=float("nan")).SerializeToString(),
        ),
        ("Allocate", pb.AllocateRequest(session_id="s" * 5000, nbytes=-1).SerializeToString()),
        ("Status", b"\x0a\x05ab"),
    ]
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        calls = {m: channel.unary_unary(f"/lpsync.v1.LpSync/{m}") for m, _ in bad}
        session = channel.stream_stream("/lpsync.v1.LpSync/Session")
        n = 0
        while not stop.is_set():
            method, payload = bad[n % len(bad)]
            n += 1
            try:
                if n % 10 == 0:
                    list(session(iter([b"\xff\xff"]), timeout=5))
                else:
                    calls[method](payload, timeout=5)
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                    raise AssertionError(f"{method}: {error.code()} {error.details()}") from None


def big(rank: int, socket: str, mib: int, stop, done, algorithm: str | None = None) -> None:
    import lpsync_client

    count = mib * (1 << 20) // 4
    try:
        with lpsync_client.connect(
            socket, job=f"big-{algorithm}", rank=rank, world_size=2, timeout=300, trigger="grpc"
        ) as client:
            x = client.empty(count, "float32")
            small = client.zeros(16, "float32")
            while not stop.is_set():
                x[:] = rank + 1
                small[:] = rank + 1
                pending = client.allreduce_async(x, algorithm=algorithm)
                # A small one of the same job right behind it: it must wait on a worker for
                # the big one, never on the event loop.
                client.allreduce(small)
                pending.result(timeout=300)
                if not (x[0] == 3 and x[count // 2] == 3 and x[-1] == 3 and small[0] == 3):
                    raise AssertionError("wrong allreduce result")
                with done.get_lock():
                    done.value += 1
    except lpsync_client.LpsyncError:
        if not stop.is_set() and serving(socket):
            raise
        # else: the daemon is shutting down (SIGTERM during "all") or the run is over


def stalled(socket: str, stop) -> None:
    import lpsync_client

    try:
        with lpsync_client.connect(
            socket, job="stalled", rank=0, world_size=2, timeout=600, trigger="grpc"
        ) as client:
            future = client.allreduce_async(client.zeros(1024), timeout=600)
            stop.wait(3600)
            future.cancel()
    except lpsync_client.LpsyncError:
        if serving(socket):
            raise  # only the daemon's shutdown may end this wait early


# -- measurement --------------------------------------------------------------------------
def _start_daemon(tmp: Path, extra: tuple[str, ...] = ()) -> tuple[launch.Process, str]:
    daemon = launch.Daemon(str(tmp / "lpsync.sock"), *extra, log=tmp / "daemon.log")
    return daemon.proc, daemon.socket


def _sample(socket: str, seconds: float, result: Result) -> None:
    import grpc

    end = time.monotonic() + seconds
    next_status = 0.0
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            ok = launch.health(socket, timeout=5.0) == "SERVING"
        except grpc.RpcError:
            ok = False
        took = time.perf_counter() - start
        result.health.append(took)
        result.failures += not ok
        if time.monotonic() >= next_status:
            start = time.perf_counter()
            launch.status(socket, recent=20, timeout=5.0)
            result.status.append(time.perf_counter() - start)
            next_status = time.monotonic() + 0.25
        time.sleep(max(0.0, 0.01 - took))


def measure(
    scenarios: tuple[str, ...] = SCENARIOS, seconds: float = 5.0, flooders: int = 4, mib: int = 256
) -> tuple[list[Result], float]:
    """Each scenario's Result and the seconds SIGTERM took to end the daemon (during the
    last scenario's load)."""
    ctx = mp.get_context("spawn")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="lpsync-responsive-") as tmp:
        proc, socket = _start_daemon(Path(tmp))
        procs: list = []
        try:
            for name in scenarios:
                stop = ctx.Event()
                done = ctx.Value("i", 0)
                procs = []
                if name in ("flood", "all"):
                    procs += [ctx.Process(target=flood, args=(socket, stop)) for _ in range(flooders)]
                if name in ("big", "direct", "all"):
                    algorithm = "direct" if name == "direct" else None
                    procs += [
                        ctx.Process(target=big, args=(r, socket, mib, stop, done, algorithm))
                        for r in range(2)
                    ]
                if name in ("stalled", "all"):
                    procs.append(ctx.Process(target=stalled, args=(socket, stop)))
                for p in procs:
                    p.start()
                # Let the load build up: the big job's first allreduce has finished.
                time.sleep(min(2.0, seconds) if procs else 0.0)
                warm = time.monotonic() + 120
                while name in ("big", "direct", "all") and done.value < 2 and time.monotonic() < warm:
                    time.sleep(0.1)
                result = Result(name)
                before = done.value
                _sample(socket, seconds, result)
                result.big_iterations = (done.value - before) // 2  # both ranks count
                results.append(result)
                if name == scenarios[-1]:
                    break  # SIGTERM under this load
                stop.set()
                _join(procs)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            sigterm = time.monotonic() - start
            stop.set()
            _join(procs)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for p in procs:
                if p.is_alive():
                    p.kill()
    return results, sigterm


def _join(procs: list) -> None:
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(5)
        if p.exitcode not in (0, None, -signal.SIGKILL):
            raise RuntimeError(f"load process {p.name} failed with exit code {p.exitcode}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.responsive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per scenario")
    parser.add_argument("--flooders", type=int, default=4, help="bad-request processes")
    parser.add_argument("--mib", type=int, default=256, help="size of the big allreduce")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results, sigterm = measure(tuple(args.scenarios.split(",")), args.seconds, args.flooders, args.mib)
    rows = [r.summary() for r in results]
    if args.json:
        print(
            json.dumps({"scenarios": rows, "sigterm_seconds": sigterm, "raw": [asdict(r) for r in results]})
        )
        return 0
    print(
        f"{'scenario':<10} {'checks':>6} {'median ms':>10} {'p99 ms':>8} {'max ms':>8} "
        f"{'status ms':>10} {'fail':>5} {'big iters':>9}"
    )
    for r in rows:
        print(
            f"{r['scenario']:<10} {r['checks']:>6} {r['health_median_ms']:>10.2f} "
            f"{r['health_p99_ms']:>8.2f} {r['health_max_ms']:>8.2f} "
            f"{r['status_median_ms']:>10.2f} {r['failures']:>5} {r['big_iterations']:>9}"
        )
    print(f"SIGTERM under the last scenario's load: exited after {sigterm:.2f} s")
    mean = statistics.fmean(r["health_median_ms"] for r in rows) if rows else 0.0
    print(f"(mean of medians {mean:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
