"""The measurements, through the project's own tools: the local benchmark
(lpsync.bench.runner), the emulated cluster (lpsync.bench.cluster), the model replay
(lpsync.bench.model_step) and the digits demo (``lpsync demo``, as a subprocess: it
launches torchrun and writes its results to --keep-logs)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from lpsync.bench.cluster_report import Point
from lpsync.errors import LpsyncError


class MeasurementError(LpsyncError):
    """A benchmark the report needs failed; the message says which."""


def local_bench(op: str, algorithm: str, sizes: list[int], procs: int, iters: int) -> list[dict[str, Any]]:
    """``lpsync bench --op OP --algorithm A --bytes ... --procs N`` on a daemon of its own:
    one row per size (median of the slowest rank's times, #wrong)."""
    from lpsync.bench import runner

    options = runner.Options(op, list(sizes), procs, algorithm, iters, warmup=1)
    try:
        rows = runner.run(options)
    except SystemExit as stop:  # the runner's way of failing
        raise MeasurementError(f"lpsync bench --op {op} --algorithm {algorithm}: {stop}") from None
    return [
        {
            "op": op,
            "algorithm": algorithm,
            "ran": r.algorithm,
            "bytes": r.nbytes,
            "seconds": r.median(),
            "wrong": r.wrong,
        }
        for r in rows["lpsync"]
    ]


def cluster_points(**fields: Any) -> list[Point]:
    """``lpsync bench --cluster`` with these ClusterOptions fields: every node count's
    points (the cluster is built and torn down inside)."""
    from lpsync.bench import cluster
    from lpsync.bench.cluster import ClusterOptions

    options = ClusterOptions(**fields)
    points: list[Point] = []
    for batch in cluster.run(options):
        points += batch
    if wrong := sum(p.wrong for p in points):
        raise MeasurementError(f"the emulated cluster returned {wrong} wrong elements")
    return points


def model_local(model: str, procs: int, iters: int) -> dict[str, Any]:
    """``lpsync bench --model NAME --procs N --compare gloo --json`` on a local daemon."""
    from lpsync.bench import model_step

    options = model_step.ModelOptions(model, procs, iters, warmup=0, compare="gloo")
    return json.loads(model_step.report(options, model_step.run(options), True))


def model_cluster(model: str, nodes: int, rate_bits: int, iters: int, transport: str) -> list[Point]:
    """``lpsync bench --model NAME --cluster --nodes N --compare gloo``: one point per mix
    and engine (algorithm = the mix, "gloo <mix>" for gloo; ``ran`` the daemons' picks)."""
    from lpsync.bench.model_step import messages

    step_bytes = 4 * sum(messages(model)["per-tensor"])
    return cluster_points(
        nodes=(nodes,),
        rate_bits=rate_bits,
        ops=("allreduce",),
        algorithms=("auto",),
        sizes=(step_bytes,),
        warmup=0,
        iters=iters,
        compare="gloo",
        model=model,
        transports=(transport,),
        prefix="lppaper",
    )


def demo(epochs: int, log: Path, nodes: int = 2, per_node: int = 2) -> dict[str, Any]:
    """``lpsync demo --epochs E --nodes N --per-node K --keep-logs DIR``: the digits trained
    by N x K trainers through lpsync, in one process and through gloo. Returns each run's
    report (per epoch, with every step's loss and accuracy) and final parameters; the demo's
    output goes to ``log``."""
    with tempfile.TemporaryDirectory(prefix="lpsync-paper-demo-") as keep:
        with open(log, "wb") as out:
            rc = subprocess.run(
                [
                    *(sys.executable, "-m", "lpsync.cli", "demo", "--epochs", str(epochs)),
                    *("--nodes", str(nodes), "--per-node", str(per_node), "--keep-logs", keep),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode
        results: dict[str, Any] = {"returncode": rc}
        for tag in ("lpsync", "single", "gloo"):
            report, params = Path(keep, f"{tag}.json"), Path(keep, f"{tag}.npy")
            if not report.exists() or not params.exists():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise MeasurementError(f"lpsync demo did not finish (exit {rc}); its output ends:\n{tail}")
            results[tag] = json.loads(report.read_text()) | {"params": np.load(params)}
    return results
