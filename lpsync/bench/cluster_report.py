"""The report of ``lpsync bench --cluster``: measured points, nccl-tests' table with the
wire limit, the CPU seconds per GB, the fixed cost of a collective stage by stage, each
time against the fewest nodes' (flat in P), JSON lines."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lpsync.bench.worker import DTYPE, bus_factor, columns
from lpsync.cluster import format_rate
from lpsync.units import format_size

AUTO = "auto"  # the daemon's tuner picks; the point reports what it ran
STAGES = ("arriving", "queued", "agreeing", "running")  # the flight recorder's, in order


@dataclass(frozen=True)
class FixedCost:
    """Where one collective's time went: the stages of the median iteration in the daemon
    that took longest over it (the node that decided the time), and the rest of that
    iteration's time (the client's side)."""

    iteration: int
    seconds: float  # this iteration's time (the slowest rank's)
    node: int  # the node whose daemon took longest
    stages: dict[str, float]  # stage -> seconds, in that daemon
    daemon: float  # its first local arrival to outcome (= the sum of the stages)
    client: float  # seconds - daemon: the request's way in and the reply's way out
    # each stage's median over all iterations, in each iteration's longest daemon
    medians: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: the stages and the client's share, in microseconds."""
        parts = [f"{name} {t * 1e6:.0f}" for name, t in self.stages.items()]
        return f"{', '.join(parts)}, client {self.client * 1e6:.0f} us"

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "seconds": self.seconds,
            "node": self.node,
            "stages": self.stages,
            "stage_medians": self.medians,
            "daemon_seconds": self.daemon,
            "client_seconds": self.client,
        }


@dataclass
class Point:
    op: str
    algorithm: str  # as requested: lp, be, ..., auto, or gloo
    ran: str  # what the daemon ran (the tuner's pick for auto)
    nodes: int
    procs_per_node: int
    rate_bits: int
    nbytes: int
    count: int
    times: list[float] = field(default_factory=list)  # per iteration, the slowest rank's
    wrong: int = 0
    # CPU seconds summed over every node process (ranks, and daemons for lpsync): over
    # the timed loop ("rank", "daemon") and over as many barriers alone ("..._barriers");
    # "machine" and "machine_barriers": the whole machine's busy seconds, the same spans.
    cpu: dict[str, float] | None = None
    # node -> its daemon's flight records of the timed iterations, oldest first
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # node -> its daemon's CPU seconds over the timed loop, the barriers' share taken out
    # (the mean of "cpu" hides node 0, which judges and answers every other node)
    daemons: dict[int, float] = field(default_factory=dict)
    transport: str = "ucx"  # the daemons' peer transport (gloo's points keep the default)

    @property
    def ranks(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def wire_seconds(self) -> float:
        return self.nbytes / (self.rate_bits / 8)

    def algbw(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def busbw(self) -> float:
        return self.algbw() * bus_factor(self.op, self.ranks)

    def cpu_seconds(self) -> float | None:
        """The timed collectives' CPU: the loop's minus the barriers' alone (never below 0:
        for tiny messages the two are close and either may be the noisier)."""
        if self.cpu is None:
            return None
        loop = self.cpu["rank"] + self.cpu["daemon"]
        barriers = self.cpu["rank_barriers"] + self.cpu["daemon_barriers"]
        return max(0.0, loop - barriers)

    def cpu_us_per_call(self, who: str) -> float | None:
        """Microseconds of CPU per collective of one process: ``who`` "daemon" (the mean
        daemon; gloo has none) or "rank" (the mean rank); the barriers' share taken out."""
        per_call = self._per_call(who, who)
        return None if per_call is None else per_call * 1e6

    def switches_per_call(self, who: str) -> float | None:
        """Context switches per collective of one process (``who`` as cpu_us_per_call):
        each a sleep and a wake-up, what a small collective's CPU is mostly made of."""
        return self._per_call(who, f"{who}_switches")

    def _per_call(self, who: str, part: str) -> float | None:
        """``part`` of self.cpu over the timed calls, the barriers' share taken out, per
        call of the mean daemon or rank (``who``); None where it was not read."""
        cpu = self.cpu
        if cpu is None or part not in cpu or not self.times or (who == "daemon" and not cpu["daemon"]):
            return None
        spent = max(0.0, cpu[part] - cpu[f"{part}_barriers"])
        processes = self.nodes if who == "daemon" else self.ranks
        return spent / processes / len(self.times)

    def daemon_us_per_call(self) -> dict[int, float]:
        """Each node's daemon: microseconds of CPU per collective (empty where not read)."""
        return {node: spent / len(self.times) * 1e6 for node, spent in self.daemons.items() if self.times}

    def cpu_per_gb(self) -> float | None:
        """CPU seconds of every node process per GB (1e9 bytes) of message: nbytes x iters."""
        cpu = self.cpu_seconds()
        return None if cpu is None else cpu / (self.nbytes * len(self.times) / 1e9)

    def machine_cpu_per_gb(self) -> float | None:
        """The whole machine's busy CPU seconds per GB of message (softirq included where
        it ran), the barriers' share taken out; None where it was not read."""
        if self.cpu is None or "machine" not in self.cpu or not self.times:
            return None
        spent = max(0.0, self.cpu["machine"] - self.cpu["machine_barriers"])
        return spent / (self.nbytes * len(self.times) / 1e9)

    def fixed_cost(self) -> FixedCost | None:
        """The stages of the median iteration (the lower one of an even count), or None
        without one complete flight record per node and iteration (gloo, --model)."""
        n = len(self.times)
        if not self.records or any(len(r) != n for r in self.records.values()) or not n:
            return None
        longest = [max((r[j] for r in self.records.values()), key=lambda rec: rec["total"]) for j in range(n)]
        i = sorted(range(n), key=self.times.__getitem__)[(n - 1) // 2]
        node = max(self.records, key=lambda m: self.records[m][i]["total"])
        record = self.records[node][i]
        stages = {s: record["stages"][s] for s in STAGES if s in record["stages"]}
        stages |= {s: t for s, t in record["stages"].items() if s not in stages}
        medians = {s: statistics.median(rec["stages"].get(s, 0.0) for rec in longest) for s in stages}
        return FixedCost(
            i, self.times[i], node, stages, record["total"], self.times[i] - record["total"], medians
        )

    def to_json(self) -> dict[str, Any]:
        fixed = self.fixed_cost()
        return {
            "op": self.op,
            "algorithm": self.algorithm,
            "ran": self.ran,
            "transport": self.transport,
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "ranks": self.ranks,
            "link": format_rate(self.rate_bits),
            "rate_bits": self.rate_bits,
            "bytes": self.nbytes,
            "count": self.count,
            "dtype": DTYPE,
            "seconds": self.seconds,
            "wire_seconds": self.wire_seconds,
            "x_wire": self.seconds / self.wire_seconds,
            "algbw_gbps": self.algbw(),
            "busbw_gbps": self.busbw(),
            "wrong": self.wrong,
            "iterations": len(self.times),
            "times": self.times,
            "cpu_seconds": self.cpu_seconds(),
            "cpu_s_per_gb": self.cpu_per_gb(),
            "machine_cpu_s_per_gb": self.machine_cpu_per_gb(),
            "daemon_cpu_us_per_call": self.cpu_us_per_call("daemon"),
            "rank_cpu_us_per_call": self.cpu_us_per_call("rank"),
            "daemon_cpu_us_per_call_by_node": [us for _, us in sorted(self.daemon_us_per_call().items())],
            "daemon_switches_per_call": self.switches_per_call("daemon"),
            "rank_switches_per_call": self.switches_per_call("rank"),
            "cpu": self.cpu,
            "fixed_cost": fixed.to_json() if fixed else None,
        }


def label(point: Point) -> str:
    """The algorithm column: auto shows its pick; a transport other than UCX is named."""
    text = f"auto:{point.ran}" if point.algorithm == AUTO else point.algorithm
    return text if point.transport == "ucx" else f"{text}@{point.transport}"


Key = tuple[str, str, int]  # (op, algorithm as requested, bytes)


def key(point: Point) -> Key:
    algorithm = point.algorithm if point.transport == "ucx" else f"{point.algorithm}@{point.transport}"
    return point.op, algorithm, point.nbytes


def table(points: list[Point], fewest: dict[Key, Point] | None = None) -> str:
    """nccl-tests' columns per (node count, op), with the CPU per GB, the wire limit, each
    time's ratio to it and, where ``fewest`` holds the same point on fewer nodes, to that;
    then the fixed cost of each lpsync point."""
    lines: list[str] = []
    for nodes, op in dict.fromkeys((p.nodes, p.op) for p in points):
        rows = [p for p in points if p.nodes == nodes and p.op == op]
        lines += _block(rows, fewest or {})
        lines += fixed_cost_lines(rows)
    return "\n".join(lines)


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _counts(rows: list[Point]) -> str:
    """The points' iteration counts: one number, or each size's (they go by size)."""
    by_size = {p.nbytes: len(p.times) for p in rows}
    if len(set(by_size.values())) == 1:
        return str(next(iter(by_size.values())))
    return "(" + ", ".join(f"{format_size(n)}: {c}" for n, c in sorted(by_size.items())) + ")"


def _block(rows: list[Point], fewest: dict[Key, Point]) -> list[str]:
    first = rows[0]
    nodes, op, k = first.nodes, first.op, first.procs_per_node
    redop, root = columns(op)
    base = {key(p): fewest[key(p)] for p in rows if key(p) in fewest and fewest[key(p)].nodes < nodes}
    vs = f"vs {min(b.nodes for b in base.values())}n" if base else ""
    lines = [
        f"# {op}: {nodes} nodes x {k} rank{'s' if k > 1 else ''} per node, "
        f"{format_rate(first.rate_bits)} full-duplex NIC per node, {DTYPE}; time = median "
        f"of {_counts(rows)} iterations of the slowest rank; cpu = CPU seconds of every "
        "node process per GB of message; machine = the same for the whole machine's busy "
        "CPU time (softirq wherever it ran); dmn/rank = CPU us per call of the mean daemon / "
        "rank; dsw/rsw = their context switches per call; wire = bytes / link rate"
        + ("; vs Nn = time / the same point's on N nodes" if base else ""),
        f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
        f"{'algorithm':>13} | {'time':>12} {'cpu':>8} {'machine':>8} {'dmn':>7} {'rank':>7} "
        f"{'dsw':>5} {'rsw':>5} {'algbw':>7} {'busbw':>7} "
        f"{'#wrong':>6} | {'wire':>12} {'x wire':>6}" + (f" {vs:>6}" if base else ""),
        f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} {'':>13} | "
        f"{'(us)':>12} {'(s/GB)':>8} {'(s/GB)':>8} {'(us)':>7} {'(us)':>7} "
        f"{'':>5} {'':>5} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} | "
        f"{'(us)':>12} {'':>6}" + (f" {'':>6}" if base else ""),
    ]
    for p in rows:
        ratio = p.seconds / base[key(p)].seconds if key(p) in base else None
        lines.append(
            f" {p.nbytes:>12} {p.count:>12} {DTYPE:>8} {redop:>6} {root:>5} "
            f"{label(p):>13} | {p.seconds * 1e6:>12.1f} {_fmt(p.cpu_per_gb(), '.4g', 8)} "
            f"{_fmt(p.machine_cpu_per_gb(), '.4g', 8)} "
            f"{_fmt(p.cpu_us_per_call('daemon'), '.0f', 7)} {_fmt(p.cpu_us_per_call('rank'), '.0f', 7)} "
            f"{_fmt(p.switches_per_call('daemon'), '.1f', 5)} {_fmt(p.switches_per_call('rank'), '.1f', 5)} "
            f"{p.algbw():>7.3f} {p.busbw():>7.3f} {p.wrong:>6} | "
            f"{p.wire_seconds * 1e6:>12.1f} {p.seconds / p.wire_seconds:>6.2f}"
            + (f" {_fmt(ratio, '.2f', 6)}" if base else "")
        )
    for nbytes in dict.fromkeys(p.nbytes for p in rows):
        same = {key(p)[1]: p for p in rows if p.nbytes == nbytes}
        if "lp" in same and len(same) > 1:
            lp = same.pop("lp")
            faster = ", ".join(f"{p.seconds / lp.seconds:.2f}x {label(p)}" for p in same.values())
            lines.append(
                f"# {format_size(nbytes)}: lp's time against the others: {faster} (>1: lp is faster)"
            )
    return lines


def fixed_cost_lines(rows: list[Point]) -> list[str]:
    """Where each lpsync point's median iteration went, from the daemons' flight records."""
    costs = [(p, f) for p in rows if (f := p.fixed_cost()) is not None]
    if not costs:
        return []
    names = list(dict.fromkeys(s for _, f in costs for s in f.stages))
    lines = [
        "# fixed cost of the median iteration, in the daemon that took longest (node): "
        "arriving = first to last local rank, queued = dispatch, agreeing = the cross-node "
        "summary exchange and waiting for the other nodes, running = the schedule and the "
        "replies' hand-off; client = time - the daemon's total (request in, reply out)",
        f"#{'size':>12} {'algorithm':>13} {'node':>4} | {'time':>10} | "
        + " ".join(f"{n:>10}" for n in names)
        + f" | {'client':>10}",
        f"#{'(B)':>12} {'':>13} {'':>4} | {'(us)':>10} | "
        + " ".join(f"{'(us)':>10}" for _ in names)
        + f" | {'(us)':>10}",
    ]
    for p, f in costs:
        lines.append(
            f" {p.nbytes:>12} {label(p):>13} {f.node:>4} | {f.seconds * 1e6:>10.1f} | "
            + " ".join(f"{f.stages.get(n, 0.0) * 1e6:>10.1f}" for n in names)
            + f" | {f.client * 1e6:>10.1f}"
        )
    return lines


def scaling(points: list[Point]) -> list[str]:
    """Each (op, algorithm, size) measured at several node counts: every count's time
    against the fewest nodes' (LP's claim: independent of P)."""
    lines = []
    for op, algorithm, nbytes in dict.fromkeys(key(p) for p in points):
        same = sorted((p for p in points if key(p) == (op, algorithm, nbytes)), key=lambda p: p.nodes)
        if len(same) > 1:
            few = same[0]
            rest = ", ".join(
                f"{p.nodes} nodes {p.seconds:.4f} s ({p.seconds / few.seconds:.2f}x)" for p in same[1:]
            )
            lines.append(
                f"# {op} {algorithm} {format_size(nbytes)}: {few.nodes} nodes {few.seconds:.4f} s, {rest}"
            )
    return lines


def emit(as_json: bool) -> Callable[[list[Point]], None]:
    """What to do with each node count's points as they come: JSON lines or the table;
    both compare each point with the same one on the fewest nodes measured before it."""
    fewest: dict[Key, Point] = {}

    def show(points: list[Point]) -> None:
        if as_json:
            rows = []
            for p in points:
                row = p.to_json()
                if (base := fewest.get(key(p))) is not None and base.nodes < p.nodes:
                    row["vs_nodes"], row["x_vs_nodes"] = base.nodes, p.seconds / base.seconds
                rows.append(json.dumps(row))
            text = "\n".join(rows)
        else:
            text = table(points, fewest)
        for p in points:
            if key(p) not in fewest or p.nodes < fewest[key(p)].nodes:
                fewest[key(p)] = p
        print(text, flush=True)

    return show
