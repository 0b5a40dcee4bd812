"""``lpsync bench``: nccl-tests-style measurements of a daemon, optionally beside gloo.

Steps, as in nccl-tests: set up (a daemon, or the one on --socket; N rank processes;
buffers), run (warm-up, timed iterations per rank, worker.py), verify (#wrong after a
final checked iteration), report (the table, or JSON with the distributions). The ranks
report as the emulated cluster's do, one JSON line per point, read by ranks.py.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lpsync.bench import ranks, worker
from lpsync.daemon import launch
from lpsync.daemon.launch import serving
from lpsync.units import format_size


@dataclass
class Row:
    nbytes: int
    count: int
    times: list[float] = field(default_factory=list)  # per iteration, slowest rank
    wrong: int = 0
    # Empty round trips on the Session stream, every rank's (pings are not synchronised
    # across ranks, so there is no "slowest rank per ping").
    pings: list[float] = field(default_factory=list)
    algorithm: str = ""  # what the daemon ran (lpsync rows)
    trigger_pings: list[float] = field(default_factory=list)  # --trigger socket

    def median(self) -> float:
        return statistics.median(self.times)


@dataclass(frozen=True)
class Options:
    op: str
    sizes: list[int]
    procs: int
    algorithm: str | None = None
    iters: int = 0
    warmup: int = 5
    compare: str | None = None
    socket: str | None = None
    timeout: float = 3600.0
    trigger: str = "auto"  # the path of collectives: socket, grpc (Session stream) or auto
    memory: str = "host"  # where the ranks' buffers live: host, emulated, cuda
    devices: str = ""  # the daemon's --devices ("" : to match --memory)
    local_nodes: int = 1  # >1: that many daemons on this machine joined over loopback
    peer_device_path: str = ""  # the local daemons' --peer-device-path ("": their default)
    native: str = ""  # the started daemon's --native ("": its default, auto)

    def daemon_flags(self) -> tuple[str, ...]:
        """The flags of the --local-nodes daemons."""
        flags: tuple[str, ...] = ("--devices", self.device_flag())
        if self.native:
            flags += ("--native", self.native)
        if self.peer_device_path:
            flags += ("--peer-device-path", self.peer_device_path)
        if self.peer_device_path == "device" and self.memory == "cuda":
            # On GPUs the direct path is UCX's cuda transports (docs/gpu.md).
            flags += ("--peer-transport", "ucx", "--ucx-tls", "tcp,cuda_copy,cuda_ipc")
        return flags

    def device_flag(self) -> str:
        if self.devices:
            return self.devices
        return {"host": "cpu", "emulated": f"emulated:{min(self.procs, 4)}", "cuda": "cuda:all"}[self.memory]

    def device_count(self) -> int:
        """How many devices the ranks spread over (rank r on device r mod N)."""
        flag = self.device_flag()
        if flag.startswith("emulated:"):
            return int(flag.split(":")[1].split(",")[0])
        if flag.startswith("cuda:") and flag != "cuda:all":
            return len(flag.split(":")[1].split(","))
        if flag == "cuda:all":
            import cupy

            return cupy.cuda.runtime.getDeviceCount()
        return 1


def run(options: Options) -> dict[str, list[Row]]:
    tmp = tempfile.mkdtemp(prefix="lpsync-bench-")  # our daemon's socket, gloo's file store
    try:
        return _run(options, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(options: Options, tmp: str) -> dict[str, list[Row]]:
    daemon = cluster = None
    socket, sockets = options.socket, []
    per_node = options.procs // options.local_nodes if options.local_nodes > 1 else 0
    if per_node:
        from lpsync.demo.local_cluster import DemoError, LocalCluster

        try:
            cluster = LocalCluster(Path(tmp), options.local_nodes, options.daemon_flags())
        except DemoError as error:
            raise SystemExit(f"lpsync bench: the daemons did not start: {error}") from None
        sockets = [node.socket for node in cluster.nodes]
    elif socket is None or not serving(socket):
        socket = socket or os.path.join(tmp, "lpsync.sock")
        try:
            native = ("--native", options.native) if options.native else ()
            daemon = launch.Daemon(
                socket, "--log-level", "WARNING", "--devices", options.device_flag(), *native
            )
        except launch.DaemonStartError as error:
            raise SystemExit(f"lpsync bench: the daemon did not start: {error}") from None
    job = f"bench-{os.getpid()}"
    engines = ["lpsync"] + ([options.compare] if options.compare else [])
    rows: dict[str, list[Row]] = {e: [] for e in engines}
    expected = len(engines) * len(options.sizes)

    def take(got: dict[int, dict]) -> None:
        first = got[0]
        row = Row(
            first["bytes"],
            first["count"],
            ranks.slowest([g["times"] for g in got.values()]),
            sum(g["wrong"] for g in got.values()),
            [p for g in got.values() for p in g.get("pings", [])],
            first.get("algorithm", ""),
            [p for g in got.values() for p in g.get("trigger_pings", [])],
        )
        rows[first["engine"]].append(row)
        done = sum(len(v) for v in rows.values())
        print(
            f"[{done}/{expected}] {first['engine']} {format_size(row.nbytes)}: {row.median() * 1e6:.1f} us",
            file=sys.stderr,
            flush=True,
        )

    workers: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(options.procs):
            plan = {
                "rank": r,
                "world": options.procs,
                "socket": sockets[r // per_node] if per_node else socket,
                "job": job,
                "op": options.op,
                "sizes": options.sizes,
                "algorithm": options.algorithm,
                "iters": options.iters,
                "warmup": options.warmup,
                "compare": options.compare,
                "trigger": options.trigger,
                "memory": options.memory,
                "devices": options.device_count(),
                "per_node": per_node,
            }
            # stderr is ours: a rank's traceback reaches the terminal as it happens
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lpsync.bench.worker", "--plan", json.dumps(plan)],
                    stdout=subprocess.PIPE,
                )
            )
        deadline = time.monotonic() + options.timeout
        ranks.read(workers, lambda row: (row["engine"], row["bytes"]), take, deadline)
        if (done := sum(len(v) for v in rows.values())) != expected:
            raise ranks.RankError(f"the ranks reported {done} of {expected} points")
    finally:
        ranks.stop(workers, 30.0)
        if daemon is not None:
            daemon.stop(30)
        if cluster is not None:
            cluster.stop()
    return rows


def report(options: Options, rows: dict[str, list[Row]], as_json: bool) -> str:
    factor = worker.bus_factor(options.op, options.procs)
    redop, root = worker.columns(options.op)

    def metrics(row: Row) -> dict:
        t = row.median()
        algbw = row.nbytes / t / 1e9
        return {
            "time_us": t * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor,
            "wrong": row.wrong,
            "mean_us": statistics.fmean(row.times) * 1e6,
            "p10_us": percentile(row.times, 10) * 1e6,
            "p90_us": percentile(row.times, 90) * 1e6,
            "iterations": len(row.times),
            "algorithm": row.algorithm,
            "ping_median_us": statistics.median(row.pings) * 1e6 if row.pings else None,
            "trigger_ping_median_us": (
                statistics.median(row.trigger_pings) * 1e6 if row.trigger_pings else None
            ),
        }

    if as_json:
        return json.dumps(
            {
                "op": options.op,
                "procs": options.procs,
                "nodes": options.local_nodes,
                "dtype": worker.DTYPE,
                "memory": options.memory,
                "algorithm": options.algorithm or "auto",
                "trigger": options.trigger,
                "results": {
                    e: [{"size": r.nbytes, "count": r.count, **metrics(r)} for r in rs]
                    for e, rs in rows.items()
                },
            },
            indent=2,
        )
    engines = list(rows)
    head1 = f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}"
    head2 = f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5}"
    for e in engines:
        head1 += f" | {e + ' time':>12} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        head2 += f" | {'(us)':>12} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
    if len(engines) > 1:
        head1 += f" | {'speedup':>7}"
    via = {
        "socket": "the trigger socket",
        "grpc": "the gRPC Session stream",
        "auto": "the client's default (trigger socket if offered)",
    }[options.trigger]
    lines = [
        f"# lpsync bench: {options.op}, {options.procs} processes"
        + (f" on {options.local_nodes} daemons (joined over loopback)" if options.local_nodes > 1 else "")
        + f", {worker.DTYPE}, algorithm {options.algorithm or 'auto (tuner)'}, collectives via {via}",
        head1,
        head2,
    ]
    for i, row in enumerate(rows["lpsync"]):
        line = f" {row.nbytes:>12} {row.count:>12} {worker.DTYPE:>8} {redop:>6} {root:>5}"
        for e in engines:
            m = metrics(rows[e][i])
            line += (
                f" | {m['time_us']:>12.1f} {m['algbw_gbps']:>7.3f} {m['busbw_gbps']:>7.3f} {m['wrong']:>6}"
            )
        if len(engines) > 1:
            line += f" | {rows[engines[1]][i].median() / row.median():>6.2f}x"
        lines.append(line)
    pings = [p for r in rows["lpsync"] for p in r.pings]
    algorithms = ", ".join(f"{format_size(r.nbytes)}: {r.algorithm}" for r in rows["lpsync"])
    lines.append(f"# lpsync algorithm per size (the daemon's choice): {algorithms}")
    small = rows["lpsync"][0]
    if pings:
        lines.append(
            f"# gRPC Session stream round trip (empty Ping, same processes and "
            f"stream): median {statistics.median(pings) * 1e6:.1f} us over "
            f"{len(pings)} pings"
        )
    trigger_pings = [p for r in rows["lpsync"] for p in r.trigger_pings]
    if trigger_pings:
        lines.append(
            f"# trigger socket round trip (empty Ping): median "
            f"{statistics.median(trigger_pings) * 1e6:.1f} us"
        )
    if pings and small.nbytes <= 1024:
        lines.append(
            f"# smallest size: median {small.median() * 1e6:.1f} us = "
            f"{small.median() / statistics.median(small.pings):.2f}x the median "
            f"Session round trip ({statistics.median(small.pings) * 1e6:.1f} us) "
            "measured in rounds alternating with it"
        )
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]
