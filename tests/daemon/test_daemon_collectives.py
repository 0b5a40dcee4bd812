"""Every op x dtypes x in/out of place, against numpy, through real daemon and clients."""

from __future__ import annotations

import itertools

from tests.daemon.harness import run_ranks
from tests.daemon.workers import check_cases

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8"]
REDUCE_OPS = ["sum", "prod", "min", "max", "avg"]


def _cases(world: int) -> list[tuple]:
    cases = []
    # Small messages (the direct path): every op, dtype, reduce op, in and out of place.
    for dt, in_place in itertools.product(DTYPES, (True, False)):
        for rop in REDUCE_OPS:
            cases.append(("allreduce", dt, rop, 37, in_place, None, 0, True))
        cases.append(("broadcast", dt, "sum", 13, in_place, None, world - 1, True))
        cases.append(
            ("reduce", dt, "max" if dt.startswith("int") else "avg", 11, in_place, None, 1 % world, True)
        )
        cases.append(("allgather", dt, "sum", 5, in_place, None, 0, True))
        cases.append(("reduce_scatter", dt, "min", 7, in_place, None, 0, True))
    # Pipelined schedules: the tuner's choice and each algorithm forced, larger buffers.
    big = 70_000  # 280 KB of float32
    for algo, op in [
        (None, "allreduce"),
        ("lp", "allreduce"),
        ("ring", "allreduce"),
        ("mst", "allreduce"),
        ("be", "allreduce"),
        ("lp", "broadcast"),
        ("lp", "reduce"),
        ("ring", "allgather"),
        ("ring", "reduce_scatter"),
        ("be", "allgather"),
        (None, "reduce_scatter"),
    ]:
        for in_place in (True, False):
            cases.append((op, "float32", "sum", big, in_place, algo, 0, True))
    cases.append(("allreduce", "bfloat16", "avg", big, True, "lp", 0, True))
    # Above the direct path's 2 MiB: the tuner's choice runs.
    cases.append(("allreduce", "float32", "sum", 600_000, True, None, 0, True))
    cases.append(("allreduce", "int32", "prod", 1000, False, "ring", 0, True))
    # Plain numpy arrays (not from client.empty): staged through shared memory.
    for op in ("allreduce", "allgather", "reduce_scatter", "broadcast"):
        cases.append((op, "float64", "sum", 9, True, None, 0, False))
        cases.append((op, "int64", "sum", 9, False, None, 0, False))
    return cases


def _check(daemon, world: int, job: str, trigger: str = "auto") -> None:
    results = run_ranks(world, check_cases, daemon.socket, job, world, _cases(world), trigger)
    failures = [f for r in results for f in r if not f.startswith("digest:")]
    assert not failures, "\n".join(failures[:30])


def test_two_ranks(daemon) -> None:
    _check(daemon, 2, "two")


def test_three_ranks(daemon) -> None:
    _check(daemon, 3, "three")


def test_two_ranks_over_the_grpc_session_stream(daemon) -> None:
    _check(daemon, 2, "two-grpc", trigger="grpc")


def test_async_calls_in_flight_together(daemon) -> None:
    from tests.daemon.workers import async_and_barrier

    r0, r1 = run_ranks(2, async_and_barrier, daemon.socket, "async")
    assert r0 == r1 == [3, 6, 9, 12, 15, 18, 2.0]


def test_bench_smoke(daemon) -> None:
    import json
    import subprocess
    import sys

    from tests.daemon.harness import ROOT

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--op",
            "allreduce",
            "--bytes",
            "4,512KiB",
            "--procs",
            "2",
            "--iters",
            "10",
            "--json",
            "--socket",
            daemon.socket,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    report = json.loads(out)
    rows = report["results"]["lpsync"]
    assert [r["size"] for r in rows] == [4, 512 * 1024]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert rows[0]["algorithm"] == "direct" and rows[0]["ping_median_us"] > 0


def test_aio_twin(daemon) -> None:
    import asyncio

    import lpsync_client.aio as lpsync_aio

    async def main() -> list:
        async with await lpsync_aio.connect(daemon.socket, job="aio", rank=0, world_size=1) as c:
            x = c.zeros(4, "int32")
            x[:] = 7
            await c.allreduce(x, op="max")
            out = c.zeros(4, "int32")
            await asyncio.gather(c.broadcast(x, out=out), c.barrier())
            return out.tolist()

    assert asyncio.run(main()) == [7, 7, 7, 7]
