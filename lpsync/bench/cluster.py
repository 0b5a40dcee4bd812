"""``lpsync bench --cluster``: daemons and clients inside an emulated cluster
(the report: cluster_report.py).

For each node count: set up (an emulated cluster, lpsync/cluster: namespaces, a
tbf-shaped full-duplex NIC per node; one ``lpsync daemon`` per namespace with every
node's 198.18.0.x address in --peers, a fresh random secret and its own socket, since
namespaces share the filesystem; K rank processes per node, cluster_worker.py), run
(every op x size x algorithm, then gloo), verify (#wrong, in the workers) and tear
down, always: on success, failure, Ctrl-C and SIGTERM. The daemons' peer plane runs
what --peer-transport names (auto: the daemon's own pick, TCP on a node without RDMA;
several: each on a fresh cluster in turn), so every byte between nodes crosses the shaped links.

A point's time is the median over iterations of the slowest rank's time; the wire
limit is bytes / link rate, the time an ideal pipeline needs to push the message
through one NIC. Its CPU is the sum over every rank and daemon of what each measured
(cluster_worker.py), its fixed cost the daemons' flight records of its iterations
(cluster_report.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from lpsync.bench import OPS, ranks, worker
from lpsync.bench.cluster_report import AUTO, Point, label
from lpsync.cluster import ClusterSpec, down, format_rate, netns, run_in, up
from lpsync.daemon import launch
from lpsync.errors import ClusterError, InvalidArgumentError
from lpsync.memory.shm import PREFIX as SHM_PREFIX
from lpsync.transport import backends
from lpsync.transport.backends import check as check_transport
from lpsync.units import format_size

PEER_PORT = 13337  # every daemon listens on its own namespace's address
GLOO_PORT = 29500  # torch.distributed's store on node 0
_START_TIMEOUT = 60.0  # seconds for every daemon to serve its socket (8 imports, 2 cores)
_START_PER_NODE = 6.0  # more per node past 8: 16 daemons importing ucxx on 2 cores take ~1 min
_STOP_TIMEOUT = 20.0  # a daemon's SIGTERM drain (10 s) plus its peer-mesh goodbye (5 s)


_MOST_ITERS = 200
_BULK_BYTES = 64 << 20
_MODEL_STEPS = 5  # --model: timed steps, each one training step's every allreduce


def cluster_iterations(nbytes: int, forced: int | None) -> int:
    """Timed calls of a point: ``forced`` (--iters), else by size: 200 up to 1 MiB, where
    a call takes milliseconds and five would leave its median to chance (the 8-node
    points spread by +-20% from call to call), down to 5 from 64 MiB, where one call
    takes seconds at 1 Gbit/s."""
    return forced or min(_MOST_ITERS, max(5, (_BULK_BYTES * 5) // nbytes))


def _resolved(transport: str) -> str:
    """``auto`` as the daemons resolve it inside the namespaces (RDMA devices are the
    host's: sysfs is not per namespace), so that points say what ran."""
    return backends.resolve(transport, backends.Rdma.scan())[0] if transport == backends.AUTO else transport


@dataclass(frozen=True)
class ClusterOptions:
    nodes: tuple[int, ...]  # node counts; one emulated cluster each, in this order
    rate_bits: int  # every node's NIC, each direction, bits per second
    ops: tuple[str, ...]
    algorithms: tuple[str, ...]  # lp, ring, mst, be, or auto (the tuner's pick)
    sizes: tuple[int, ...]  # bytes, float32
    procs_per_node: int = 1  # client ranks per node (node-major, as torchrun numbers them)
    warmup: int = 1
    iters: int | None = None  # timed calls per point; None: by size (cluster_iterations)
    compare: str | None = None  # "gloo": torch.distributed on the same namespaces
    prefix: str = "lpbench"  # namespace names PREFIX-n<i>, PREFIX-sw
    logs: str | None = None  # keep every daemon's and rank's log under logs/<N>nodes/
    model: str | None = None  # --model: replay this network's step instead of ops x sizes
    transports: tuple[str, ...] = ("auto",)  # the daemons' peer transport; each in turn
    natives: tuple[str, ...] = ("auto",)  # the daemons' --native; each in turn, per transport
    collective_timeout: float = 600.0  # seconds, each collective (client and daemon)
    timeout: float = 3600.0  # seconds, one node count from cluster up to the last point

    def __post_init__(self) -> None:
        if not (self.nodes and self.ops and self.algorithms and self.sizes):
            raise InvalidArgumentError("--nodes, --op, --algorithm and --bytes must not be empty")
        for n in self.nodes:
            if n < 2:
                raise InvalidArgumentError(f"--nodes: a cluster needs 2 or more nodes, got {n}")
            ClusterSpec(n, self.rate_bits, prefix=self.prefix)  # at most 254; the prefix
        if self.procs_per_node < 1:
            raise InvalidArgumentError("--procs-per-node must be >= 1")
        if (self.iters is not None and self.iters < 1) or self.warmup < 0:
            raise InvalidArgumentError("--iters must be >= 1 and --warmup >= 0")
        unknown: list[str] | list[int]  # ops, then sizes
        if unknown := [op for op in self.ops if op not in OPS]:
            raise InvalidArgumentError(f"--op {','.join(unknown)}: expected some of {', '.join(OPS)}")
        if unknown := [s for s in self.sizes if s < 4]:
            raise InvalidArgumentError(f"--bytes: sizes must be >= 4 (one float32), got {unknown}")
        # auto as the daemons will resolve it, so that every point says what ran
        object.__setattr__(self, "transports", tuple(map(_resolved, self.transports)))
        for transport in self.transports:
            check_transport(transport)
        if not self.transports:
            raise InvalidArgumentError("--peer-transport must not be empty")
        if not self.natives or any(n not in ("auto", "on", "off") for n in self.natives):
            raise InvalidArgumentError(f"--native {','.join(self.natives)}: expected auto, on or off")
        if self.compare not in (None, "gloo"):
            raise InvalidArgumentError(f"--compare {self.compare}: only gloo")
        for algorithm in self.algorithms:
            if not any(algorithm in self.offered(op) for op in self.ops):
                offered = "; ".join(f"{op}: {', '.join(self.offered(op))}" for op in self.ops)
                raise InvalidArgumentError(
                    f"--algorithm {algorithm} runs none of the ops asked for ({offered})"
                )

    @staticmethod
    def offered(op: str) -> list[str]:
        return [*worker.algorithms_of(op), AUTO]

    def algorithms_of(self, op: str) -> list[str]:
        """The requested algorithms that have ``op`` (ring has no broadcast, for one)."""
        return [a for a in self.algorithms if a in self.offered(op)]

    def skipped(self) -> list[str]:
        return [f"{a} has no {op}" for op in self.ops for a in self.algorithms if a not in self.offered(op)]

    def plan(self, nodes: int, daemon_pids: list[int] | None = None) -> dict[str, Any]:
        """What every rank runs (cluster_worker.py --plan); the job name carries the prefix,
        so every process of a run can be found by it. Local rank 0 of node n reads the CPU
        time of ``daemon_pids[n]``."""
        plan = {
            "job": f"{self.prefix}-{nodes}",
            "ops": list(self.ops),
            "daemon_pids": list(daemon_pids or []),
            "sizes": list(self.sizes),
            "warmup": self.warmup,
            # timed calls per size (bytes as text: JSON keys), and per --model step
            "iters": {str(n): cluster_iterations(n, self.iters) for n in self.sizes},
            "steps": self.iters or _MODEL_STEPS,
            "compare": self.compare,
            "timeout": self.collective_timeout,
            "algorithms": {op: self.algorithms_of(op) for op in self.ops},
        }
        if self.model:
            from lpsync.bench.model_step import messages

            plan["model"] = messages(self.model)
        return plan

    def flight_recorder(self) -> int:
        """Records each daemon keeps per job: a point's warmups, its timed calls with the
        barrier before each, the barriers alone and the verify pass, with room to spare."""
        # --model's steps (--iters, or 5) never exceed the largest count by size
        return 3 * max(cluster_iterations(n, self.iters) for n in self.sizes) + self.warmup + 64

    def points_per_cluster(self) -> int:
        if self.model:  # one point per message mix and engine
            from lpsync.bench.model_step import MODES

            return len(MODES) * (1 + (self.compare is not None))
        per_size = sum(len(self.algorithms_of(op)) + (self.compare is not None) for op in self.ops)
        return per_size * len(self.sizes)


def progress(message: str) -> None:
    print(f"lpsync bench --cluster: {message}", file=sys.stderr, flush=True)


def run(options: ClusterOptions) -> Iterator[list[Point]]:
    """Each node count's points, once its cluster is down again: every (transport, --native)
    in turn, each on a fresh cluster (gloo, if compared, runs with the first)."""
    netns.require_root()
    variants = [(t, n) for t in options.transports for n in options.natives]
    with _Interrupts() as interrupts:
        for nodes in options.nodes:
            points = []
            for i, (transport, native) in enumerate(variants):
                points += _run_nodes(
                    replace(options, compare=options.compare if i == 0 else None),
                    nodes,
                    interrupts,
                    transport,
                    native,
                )
            yield points


@dataclass
class _Node:
    daemon: subprocess.Popen[bytes]
    socket: str
    log: Path


def _run_nodes(
    options: ClusterOptions, nodes: int, interrupts: _Interrupts, transport: str, native: str = "auto"
) -> list[Point]:
    spec = ClusterSpec(nodes, options.rate_bits, prefix=options.prefix)
    try:
        up(spec)  # removes what it made if it fails or is interrupted halfway
    except ClusterError as error:
        raise ClusterError(f"cannot build the emulated cluster: {error}") from None
    tmp = Path(tempfile.mkdtemp(prefix=f"lpsync-bench-{options.prefix}-"))
    daemons: list[_Node] = []  # filled as they start, so teardown sees every one
    workers: list[subprocess.Popen[bytes]] = []
    try:
        progress(
            f"{nodes} nodes: cluster {spec.prefix!r} up "
            f"({format_rate(spec.rate_bits)} full duplex per node; peer transport "
            f"{transport}, --native {native})"
        )
        _start_daemons(spec, options, tmp, daemons, transport, native)
        pids = ", ".join(str(d.daemon.pid) for d in daemons)
        progress(
            f"{nodes} nodes: {nodes} daemons serving (pids {pids}); starting "
            f"{nodes * options.procs_per_node} ranks"
        )
        _start_workers(spec, options, daemons, tmp, workers)
        points = _collect(options, nodes, workers, daemons, tmp)
        for point in points:
            if point.algorithm != "gloo" and not point.algorithm.startswith("gloo "):
                point.transport = transport if native == "auto" else f"{transport} native {native}"
        return points
    finally:
        with interrupts.deferred():
            _stop(workers, daemons)
            down(spec.prefix)
            _reclaim(daemons)
            if options.logs:
                where = f"{nodes}nodes" + ("" if transport == "ucx" else f"-{transport}")
                where += "" if native == "auto" else f"-native-{native}"
                try:
                    shutil.copytree(
                        tmp,
                        Path(options.logs) / where,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.sock*"),
                    )
                except OSError as error:
                    progress(f"could not keep the logs in {options.logs}: {error}")
            shutil.rmtree(tmp, ignore_errors=True)
            progress(f"{nodes} nodes: torn down")


def _clean_env() -> dict[str, str]:
    # The user's LPSYNC_* settings (a socket, a peer source) must not reach our daemons.
    return {k: v for k, v in os.environ.items() if not k.startswith("LPSYNC_")}


def _start_daemons(
    spec: ClusterSpec,
    options: ClusterOptions,
    tmp: Path,
    daemons: list[_Node],
    transport: str = "ucx",
    native: str = "auto",
) -> None:
    peers = ",".join(f"{spec.address(i)}:{PEER_PORT}" for i in range(spec.nodes))
    env = {
        **_clean_env(),
        "LPSYNC_SECRET": secrets.token_hex(32),
        "LPSYNC_UCX_TLS": "tcp",
        "LPSYNC_PEER_TRANSPORT": transport,
        "LPSYNC_NATIVE": native,
    }
    for node in range(spec.nodes):
        where = tmp / f"node{node}"
        where.mkdir()
        socket, log = str(where / "lpsync.sock"), where / "daemon.log"
        flags = ("--node-rank", str(node), "--peers", peers, "--log-level", "INFO")
        # In a session of their own: Ctrl-C reaches us, and we stop them in order.
        started = launch.Daemon(
            socket,
            *flags,
            "--flight-recorder",
            str(options.flight_recorder()),
            log=log,
            env=env,
            wrap=("ip", "netns", "exec", spec.namespace(node)),
            start_new_session=True,
            wait=False,
        )
        assert isinstance(started.proc, subprocess.Popen)  # launch.Daemon's own spawn
        daemons.append(_Node(started.proc, socket, log))
    deadline = time.monotonic() + _START_TIMEOUT + _START_PER_NODE * max(0, spec.nodes - 8)
    for node, d in enumerate(daemons):
        while not launch.serving(d.socket):
            if d.daemon.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"the daemon of node {node} did not start:\n{_tail(d.log)}")
            time.sleep(0.1)


def _start_workers(
    spec: ClusterSpec,
    options: ClusterOptions,
    daemons: list[_Node],
    tmp: Path,
    workers: list[subprocess.Popen[bytes]],
) -> None:
    k = options.procs_per_node
    world = spec.nodes * k
    # `ip netns exec` execs the command: each Popen's pid is its daemon's.
    plan = json.dumps(options.plan(spec.nodes, [d.daemon.pid for d in daemons]))
    for rank in range(world):
        node = rank // k
        env = {
            **_clean_env(),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % k),
            "LOCAL_WORLD_SIZE": str(k),
            "LPSYNC_SOCKET": daemons[node].socket,
            # gloo: its store on node 0, its sockets on the shaped NIC
            "MASTER_ADDR": spec.address(0),
            "MASTER_PORT": str(GLOO_PORT),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
        }
        with open(tmp / f"rank{rank}.log", "wb") as err:
            proc = run_in(
                spec,
                node,
                [sys.executable, "-m", "lpsync.bench.cluster_worker", "--plan", plan],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        workers.append(proc)


def _collect(
    options: ClusterOptions,
    nodes: int,
    workers: list[subprocess.Popen[bytes]],
    daemons: list[_Node],
    tmp: Path,
) -> list[Point]:
    """Every rank's points (ranks.read); a rank or daemon that fails ends the run with its log."""
    expected = options.points_per_cluster()
    points: list[Point] = []

    def daemons_alive() -> None:
        for node, d in enumerate(daemons):
            if d.daemon.poll() is not None:
                raise ClusterError(
                    f"the daemon of node {node} exited with code {d.daemon.returncode}:\n{_tail(d.log)}"
                )

    def take(rows: dict[int, dict[str, Any]]) -> None:
        point = _point(options, nodes, rows)
        points.append(point)
        progress(
            f"[{len(points)}/{expected}] {nodes} nodes {point.op} "
            f"{label(point)} {format_size(point.nbytes)}: "
            f"{point.seconds:.4f} s = {point.seconds / point.wire_seconds:.2f}"
            f"x wire, {_cpu_text(point)}, #wrong {point.wrong}"
        )

    ranks.read(
        workers,
        lambda row: (row["engine"], row["op"], row["algorithm"], row["bytes"]),
        take,
        time.monotonic() + options.timeout,
        daemons_alive,
        lambda rank: f"rank {rank} (node {rank // options.procs_per_node})",
        lambda rank: _tail(tmp / f"rank{rank}.log"),
    )
    if len(points) != expected:
        raise ClusterError(f"{nodes} nodes: got {len(points)} of {expected} points")
    return points


def _point(options: ClusterOptions, nodes: int, got: dict[int, dict[str, Any]]) -> Point:
    """One point from every rank's row of it."""
    row = got[0]
    cpu = None
    if all("cpu" in r for r in got.values()):  # --model's rows carry none
        cpu = {part: sum(r["cpu"][part] for r in got.values()) for part in row["cpu"]}
    records = {r["node"]: r["records"] for r in got.values() if r.get("node") is not None}
    daemons = {
        r["node"]: max(0.0, r["cpu"]["daemon"] - r["cpu"]["daemon_barriers"])
        for r in got.values()
        if r.get("node") is not None and "cpu" in r
    }
    return Point(
        row["op"],
        row["algorithm"],
        got[0]["ran"],
        nodes,
        options.procs_per_node,
        options.rate_bits,
        row["bytes"],
        row["count"],
        ranks.slowest([r["times"] for r in got.values()]),
        sum(r["wrong"] for r in got.values()),
        cpu,
        records,
        daemons,
    )


def _cpu_text(point: Point) -> str:
    """The progress line's CPU per GB and, for lpsync, where the median iteration went."""
    per_gb = point.cpu_per_gb()
    text = "cpu -" if per_gb is None else f"cpu {per_gb:.4g} s/GB"
    if (machine := point.machine_cpu_per_gb()) is not None:
        text += f" (machine {machine:.4g})"
    if len(by_node := point.daemon_us_per_call()) > 1:  # one daemon: the mean says it
        busiest = max(by_node, key=by_node.__getitem__)
        text += f", daemons {min(by_node.values()):.0f}-{by_node[busiest]:.0f} us/call (most: node {busiest})"
    fixed = point.fixed_cost()
    return text if fixed is None else f"{text} ({fixed.summary()})"


def _stop(workers: list[subprocess.Popen[bytes]], daemons: list[_Node]) -> None:
    """Ranks first, then the daemons with SIGTERM (they drain, say goodbye to their
    peers and unlink their shared memory); whatever outlives that is killed."""
    ranks.stop(workers, 5.0)
    ranks.stop([d.daemon for d in daemons], _STOP_TIMEOUT)


def _reclaim(daemons: list[_Node]) -> None:
    """Unlink what a daemon that had to be killed left in /dev/shm (named after its pid)."""
    for d in daemons:
        for path in Path("/dev/shm").glob(f"{SHM_PREFIX}{d.daemon.pid}-*"):
            path.unlink(missing_ok=True)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt, except during teardown: there they are
    noted and raised once it is over, so a second Ctrl-C cannot leave namespaces behind."""

    def __init__(self) -> None:
        self._old: dict[int, Any] = {}
        self._deferring = False
        self._pending: int | None = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:
            self._pending = signum
            progress("interrupted; tearing down first")
            return
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise KeyboardInterrupt(f"signal {signum}")
