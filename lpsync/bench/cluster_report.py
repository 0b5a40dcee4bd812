"""The report of ``lpsync bench --cluster``: measured points, nccl-tests' table with the
wire limit, JSON lines."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lpsync.algorithms.cost import busbw_factor
from lpsync.bench.worker import DTYPE
from lpsync.cluster import format_rate
from lpsync.types import Collective
from lpsync.units import format_size

AUTO = "auto"  # the daemon's tuner picks; the point reports what it ran


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
        return self.algbw() * busbw_factor(Collective(self.op), self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "algorithm": self.algorithm, "ran": self.ran,
                "nodes": self.nodes, "procs_per_node": self.procs_per_node,
                "ranks": self.ranks, "link": format_rate(self.rate_bits),
                "rate_bits": self.rate_bits, "bytes": self.nbytes, "count": self.count,
                "dtype": DTYPE, "seconds": self.seconds, "wire_seconds": self.wire_seconds,
                "x_wire": self.seconds / self.wire_seconds, "algbw_gbps": self.algbw(),
                "busbw_gbps": self.busbw(), "wrong": self.wrong,
                "iterations": len(self.times), "times": self.times}


def label(point: Point) -> str:
    return f"auto:{point.ran}" if point.algorithm == AUTO else point.algorithm


def table(points: list[Point]) -> str:
    """nccl-tests' columns per (node count, op), with the wire limit and each time's ratio."""
    lines: list[str] = []
    for nodes, op in dict.fromkeys((p.nodes, p.op) for p in points):
        lines += _block([p for p in points if p.nodes == nodes and p.op == op])
    return "\n".join(lines)


def _block(rows: list[Point]) -> list[str]:
    first = rows[0]
    nodes, op, k = first.nodes, first.op, first.procs_per_node
    root = 0 if op in ("broadcast", "reduce") else -1
    redop = "sum" if op in ("allreduce", "reduce", "reduce_scatter") else "none"
    lines = [f"# {op}: {nodes} nodes x {k} rank{'s' if k > 1 else ''} per node, "
             f"{format_rate(first.rate_bits)} full-duplex NIC per node, {DTYPE}; time = median "
             f"of {len(first.times)} iterations of the slowest rank; wire = bytes / link rate",
             f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
             f"{'algorithm':>10} | {'time':>12} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | "
             f"{'wire':>12} {'x wire':>6}",
             f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} {'':>10} | "
             f"{'(us)':>12} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} | {'(us)':>12} {'':>6}"]
    for p in rows:
        lines.append(f" {p.nbytes:>12} {p.count:>12} {DTYPE:>8} {redop:>6} {root:>5} "
                     f"{label(p):>10} | {p.seconds * 1e6:>12.1f} {p.algbw():>7.3f} "
                     f"{p.busbw():>7.3f} {p.wrong:>6} | {p.wire_seconds * 1e6:>12.1f} "
                     f"{p.seconds / p.wire_seconds:>6.2f}")
    for nbytes in dict.fromkeys(p.nbytes for p in rows):
        same = {p.algorithm: p for p in rows if p.nbytes == nbytes}
        if "lp" in same and len(same) > 1:
            lp = same.pop("lp")
            faster = ", ".join(f"{p.seconds / lp.seconds:.2f}x {label(p)}"
                               for p in same.values())
            lines.append(f"# {format_size(nbytes)}: lp's time against the others: {faster} "
                         "(>1: lp is faster)")
    return lines


def scaling(points: list[Point]) -> list[str]:
    """Each (op, algorithm, size) measured at several node counts: the time at the most
    nodes against the fewest (LP's claim: independent of P)."""
    lines = []
    keys = dict.fromkeys((p.op, p.algorithm, p.nbytes) for p in points)
    for op, algorithm, nbytes in keys:
        same = sorted((p for p in points if (p.op, p.algorithm, p.nbytes) == (op, algorithm,
                                                                             nbytes)),
                      key=lambda p: p.nodes)
        if len(same) > 1:
            few, many = same[0], same[-1]
            lines.append(f"# {op} {algorithm} {format_size(nbytes)}: {few.nodes} nodes "
                         f"{few.seconds:.4f} s, {many.nodes} nodes {many.seconds:.4f} s "
                         f"({many.seconds / few.seconds:.2f}x)")
    return lines


def emit(as_json: bool) -> Callable[[list[Point]], None]:
    """What to do with each node count's points as they come: JSON lines or the table."""
    def show(points: list[Point]) -> None:
        text = "\n".join(json.dumps(p.to_json()) for p in points) if as_json else table(points)
        print(text, flush=True)
    return show
