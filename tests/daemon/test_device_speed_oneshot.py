"""The one-shot device allreduce (issue 47, item 3) end to end on the emulated device: a
real daemon (--devices emulated:2), client processes with emulated device arrays, results
bitwise against numpy reduced in rank order, the algorithm each collective ran read from
the daemon's metrics (lpsync_collective_seconds_count by algorithm)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import lpsync_client
import tests.daemon.device_workers as device_workers
from tests.daemon.harness import DaemonProcess, run_ranks
from tests.ports import free_ports

_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "float16": np.float16}
_DTYPES["bfloat16"] = ml_dtypes.bfloat16


def rank_order(inputs: list[np.ndarray], reduce_op: str) -> np.ndarray:
    """The reference: rank 0's input combined with rank 1's, then rank 2's, ... in the
    dtype itself (numpy's rounding at every step), avg divided once at the end."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = _UFUNCS[reduce_op](acc, x)
    if reduce_op == "avg":
        p = len(inputs)
        if np.issubdtype(acc.dtype, np.integer):
            acc = np.floor_divide(acc, p)
        else:
            acc = np.divide(acc, np.asarray(p, dtype=acc.dtype))
    return acc


def _inputs(dtype: str, world: int, count: int, reduce_op: str, rng: np.random.Generator) -> list[np.ndarray]:
    dt = np.dtype(_DTYPES[dtype])
    out = []
    for _ in range(world):
        if dt.kind == "i":
            info = np.iinfo(dt)
            out.append(rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt))
        elif reduce_op == "prod":
            out.append((1.0 + rng.uniform(-0.1, 0.1, size=count)).astype(dt))
        else:
            out.append(rng.uniform(-1.0, 1.0, size=count).astype(dt))
    return out


def _algorithms(port: int) -> dict[str, float]:
    """Collectives counted per algorithm for allreduce (the daemon's metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^lpsync_collective_seconds_count\{([^}]*)\} (\S+)$", text, re.M):
        if 'op="allreduce"' in labels:
            name = re.search(r'algorithm="([^"]*)"', labels)
            assert name is not None
            counts[name[1]] = counts.get(name[1], 0.0) + float(value)
    return counts


@pytest.fixture
def emu(tmp_path: Path):
    port = free_ports(1)[0]
    proc = DaemonProcess(tmp_path, "--devices", "emulated:2", "--metrics-port", str(port))
    proc.metrics_port = port  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.stop_and_check()


def _cases(world: int, count: int, seed: int, in_place: bool) -> list[tuple]:
    rng = np.random.default_rng(seed)
    cases = []
    for dtype in _DTYPES:
        for reduce_op in ("sum", "prod", "min", "max", "avg"):
            inputs = _inputs(dtype, world, count, reduce_op, rng)
            cases.append(("allreduce", dtype, reduce_op, in_place, 0, count, [x.tobytes() for x in inputs]))
    return cases


def _check(cases: list[tuple], results: list, world: int) -> None:
    for i, (_, dtype, reduce_op, _, _, _, inputs) in enumerate(cases):
        dt = np.dtype(_DTYPES[dtype])
        want = rank_order([np.frombuffer(x, dt) for x in inputs], reduce_op).tobytes()
        for rank in range(world):
            got = results[rank][i][0]
            assert got == want, f"{dtype} {reduce_op} rank {rank}: not bitwise the rank-order reduction"


def test_device_speed_oneshot_four_processes_on_one_device_bitwise(emu):
    """The GPU check's shape: 4 processes on one device, every served-kind dtype and reduce
    op, out of place and in place: each one launch, each bitwise numpy's rank order."""
    world, count = 4, 1000
    cases = _cases(world, count, 47, in_place=False) + _cases(world, count, 48, in_place=True)
    results = run_ranks(world, device_workers.run_cases, emu.socket, world, [0] * world, cases, timeout=240)
    _check(cases, results, world)
    assert _algorithms(emu.metrics_port) == {"oneshot": float(len(cases))}


def test_device_speed_oneshot_across_two_devices(emu):
    """Ranks on devices 0, 1, 0, 1: one launch per device out of place (peer reads); in
    place the buffers refuse it (a launch would overwrite what the other one reads) and
    the chain runs, with the same data right either way."""
    world, count = 4, 300
    out_of_place = _cases(world, count, 7, in_place=False)[:5]  # float32, every reduce op
    results = run_ranks(world, device_workers.run_cases, emu.socket, world, [0, 1, 0, 1], out_of_place)
    _check(out_of_place, results, world)
    assert _algorithms(emu.metrics_port) == {"oneshot": 5.0}
    in_place = [c for c in _cases(world, count, 8, in_place=True) if c[1] == "int32"]  # exact on any path
    results = run_ranks(world, device_workers.run_cases, emu.socket, world, [0, 1, 0, 1], in_place)
    _check(in_place, results, world)
    counts = _algorithms(emu.metrics_port)
    assert counts.pop("oneshot") == 5.0 and sum(counts.values()) == 5.0, counts


def test_device_speed_oneshot_threshold_and_forced(emu):
    """At the cap (256 KiB) the tuner gives it the one-shot, one element past it not; a
    forced algorithm (lp) runs as forced below the cap; all three bitwise right (int32)."""
    world = 4
    at_cap = 256 * 1024 // 4
    rng = np.random.default_rng(3)
    cases = [
        (
            "allreduce",
            "int32",
            "sum",
            False,
            0,
            n,
            [x.tobytes() for x in _inputs("int32", world, n, "sum", rng)],
        )
        for n in (at_cap, at_cap + 1)
    ]
    results = run_ranks(world, device_workers.run_cases, emu.socket, world, [0] * world, cases, timeout=240)
    _check(cases, results, world)
    counts = _algorithms(emu.metrics_port)
    assert counts.pop("oneshot") == 1.0 and sum(counts.values()) == 1.0, counts
    forced = cases[:1]
    results = run_ranks(
        world, device_workers.run_cases, emu.socket, world, [0] * world, forced, "emulated", "lp", timeout=240
    )
    _check(forced, results, world)
    assert _algorithms(emu.metrics_port)["lp"] == 1.0


def test_device_speed_oneshot_ready_event_never_fires(emu):
    """Rank 0's ready event is held past the 1 s timeout: every rank hears
    CollectiveTimeoutError, the next one-shot allreduce of the job is right, and once the
    buffers are released nothing stays mapped."""
    world = 4
    results = run_ranks(world, device_workers.oneshot_ready_never_fires, emu.socket, world, 4.0, timeout=120)
    for r in results:
        assert r["first"] == "CollectiveTimeoutError", r
        assert r["second"] == [10.0, 10.0], r  # 1 + 2 + 3 + 4
    assert _algorithms(emu.metrics_port).get("oneshot") == 1.0  # the timed-out one is not counted
    with lpsync_client.connect(emu.socket, job="status", rank=0, world_size=1) as client:
        rows = client.status().devices
    assert all(row.open_allocations == 0 and row.registered_bytes == 0 for row in rows)
    assert all(row.ipc_opens == row.ipc_closes for row in rows)


def test_device_speed_oneshot_rank_order_reference_is_not_the_chains_order() -> None:
    """The reference can tell orders apart: float32 sums in rank order and in another
    order differ for these inputs (so a bitwise match above is a real check of order)."""
    rng = np.random.default_rng(47)
    inputs = _inputs("float32", 4, 1000, "sum", rng)
    assert rank_order(inputs, "sum").tobytes() != rank_order(inputs[::-1], "sum").tobytes()
