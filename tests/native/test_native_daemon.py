"""The native steady-state path with real daemons and rank processes: every collective
case through both paths (--native on and off), bitwise against each other and numpy,
and collectives above 2 MiB (the engine's tiles and threads on; the host pipeline off);
and every failure path the error table names, provoked while a rank rings the doorbell:
a mismatch, a rank that never comes, a rank that dies (also while a big armed program
runs), a released buffer, a daemon that is killed. Nothing may hang or leak (the
daemon's stop checks shared memory)."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync.daemon.collectives.local import SCHEDULE_NATIVE_MAX_BYTES
from lpsync.daemon.collectives.views import nccl_bytes
from lpsync.native import engine as native_engine
from lpsync.types import DTYPES, Collective, ReduceOp
from lpsync_client.wire.proto import lpsync_pb2 as pb
from tests.collective_cases import check_case_results, every_case, in_elements, make_inputs
from tests.daemon.harness import DaemonProcess, cli_status, helper_context, run_ranks, shm_segments
from tests.native import workers
from tests.ports import free_ports

WORLD = 3


def _daemon(tmp: Path, native: str) -> DaemonProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    return DaemonProcess(tmp, "--native", native)


def test_every_case_bitwise_on_both_paths(tmp_path: Path) -> None:
    """Every op x dtype x reduce op, in and out of place, repeated on the same buffers: the
    engine answers the repeats of what it serves; the results are the Python path's bits,
    and numpy's."""
    assert native_engine() is not None, "the native engine is not built (the install builds it)"
    cases = every_case(WORLD, 29, root=1, seed=44)
    on, off = _on_and_off(tmp_path, cases)
    assert on["path"] == "native"
    # Every case is served (float min/max too): its 3rd and 4th calls.
    assert on["answered"] - on["fallbacks"] >= 2 * len(cases), on
    assert off["path"] == "python (--native off)" and off["answered"] == 0


def _on_and_off(tmp_path: Path, cases: list, algorithms: list[str | None] | None = None) -> tuple[dict, dict]:
    """Run ``cases`` (with ``algorithms`` forced, one per case) on a daemon with --native
    on, then one with off; each against numpy, the two bitwise alike. Rank 0's path info
    of each run."""
    outputs, infos = {}, {}
    for native in ("on", "off"):
        daemon = _daemon(tmp_path / native, native)
        try:
            ranks = run_ranks(
                WORLD,
                workers.run_cases,
                daemon.socket,
                WORLD,
                cases,
                workers.REPEATS,
                algorithms,
                timeout=240,
            )
        finally:
            daemon.stop_and_check()
        results = [r[0] for r in ranks]
        check_case_results(cases, results, WORLD, inputs_kept=True)
        outputs[native], infos[native] = results, ranks[0][1]
    assert outputs["on"] == outputs["off"]
    return infos["on"], infos["off"]


MiB = 1 << 20
# Above DIRECT_MAX_BYTES (2 MiB, nccl-tests' sizes): (op, dtype, reduce op, in place, root,
# elements per block). Every block no multiple of the engine's tile or of its threads.
BIG = [
    ("allreduce", "float32", "sum", False, 0, 2 * MiB // 4 + 3),
    ("allreduce", "bfloat16", "avg", True, 0, 2 * MiB // 2 + 1),
    ("reduce", "int32", "prod", True, 1, 2 * MiB // 4 + 5),
    ("broadcast", "float64", "sum", True, 2, 2 * MiB // 8 + 7),
    ("reduce_scatter", "int64", "max", False, 0, MiB // 8 + 1),
    ("allgather", "uint8", "sum", True, 0, MiB + 9),
    ("reduce", "float16", "sum", False, 2, 2 * MiB // 2 + 9),
]


def _big_cases(world: int, seed: int) -> list[tuple]:
    """BIG's cases with every_case's tuples. Floats are small integers (bfloat16's within
    its 8 bits): every order of the sums is exact, so the host pipeline's order (off) and
    the engine's rank order (on) give the same bits; integers span their whole range."""
    rng = np.random.default_rng(seed)
    cases = []
    for op, dtype, reduce_op, in_place, root, count in BIG:
        dt = DTYPES[dtype]
        inputs = []
        for rank in range(world):
            n = in_elements(Collective(op), world, count, rank, root)
            if dt.kind in "iu":
                info = np.iinfo(dt)
                x = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dt)
            else:
                x = rng.integers(-60, 60, size=n).astype(dt)
            inputs.append(x.tobytes())
        cases.append((op, dtype, reduce_op, in_place, root, count, inputs))
    return cases


def test_big_collectives_bitwise_on_both_paths(tmp_path: Path) -> None:
    """Above 2 MiB, --native on runs the direct program in the engine (armed from the first
    call) and off the host pipeline: both numpy's answer, the same bits."""
    cases = _big_cases(WORLD, seed=45)
    on, off = _on_and_off(tmp_path, cases)
    assert on["path"] == "native"  # armed at the first call: the doorbell answers the later ones
    assert on["answered"] - on["fallbacks"] >= 2 * len(cases), on
    assert off["answered"] == 0, off


# Per float type: NaNs (quiet with payloads, of both signs; signalling), +-0, +-inf, 1.
SPECIALS = {
    "float16": [0x7E01, 0xFE02, 0x7C03, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x3C00],
    "bfloat16": [0x7FC1, 0xFFC2, 0x7F83, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x3F80],
    "float32": [0x7FC00001, 0xFFC00002, 0x7F800003, 0, 0x80000000, 0x7F800000, 0xFF800000, 0x3F800000],
    "float64": [
        0x7FF8000000000001,
        0xFFF8000000000002,
        0x7FF0000000000003,
        0,
        0x8000000000000000,
        0x7FF0000000000000,
        0xFFF0000000000000,
        0x3FF0000000000000,
    ],
}


def _special_cases() -> list[tuple]:
    """Float min and max of allreduce and reduce_scatter, in and out of place, over every
    triple of SPECIALS (rank r holds the r-th of each): ties of -0 and +0, NaN against NaN
    and against numbers, in every order of the ranks."""
    assert WORLD == 3
    cases = []
    for dtype, table in SPECIALS.items():
        values = np.array(table, f"u{DTYPES[dtype].itemsize}")
        index = np.indices((len(table),) * WORLD).reshape(WORLD, -1)
        count = index.shape[1]
        for op, blocks in (("allreduce", 1), ("reduce_scatter", WORLD)):
            for reduce_op in ("min", "max"):
                for in_place in (False, True):
                    inputs = [np.tile(values[index[r]], blocks).tobytes() for r in range(WORLD)]
                    cases.append((op, dtype, reduce_op, in_place, 0, count, inputs))
    return cases


def test_float_min_max_run_armed_with_numpys_bits(tmp_path: Path) -> None:
    """Float min and max over NaNs, signed zeros and infinities: the engine answers their
    repeats (on), with the Python path's bits (off) and numpy's (np.minimum and np.maximum
    in rank order, compared bitwise: NaN payloads and zero signs too)."""
    cases = _special_cases()
    on, off = _on_and_off(tmp_path, cases)
    assert on["path"] == "native", on
    assert on["answered"] - on["fallbacks"] >= 2 * len(cases), on
    assert off["answered"] == 0, off


# Forced algorithms on one node: (op, dtype, reduce op, in place, root, elements per
# block, algorithm). Floats in [-1, 1] whose sums' bits depend on their order: on and off
# agree only where the engine keeps the schedule's order.
FORCED = [
    ("allreduce", "float32", "sum", False, 0, 1001, "ring"),
    ("allreduce", "float64", "avg", True, 0, 999, "lp"),
    ("allreduce", "bfloat16", "max", False, 0, 513, "mst"),
    ("allreduce", "float16", "sum", True, 0, 257, "be"),
    ("reduce", "float32", "sum", False, 2, 1003, "lp"),
    ("reduce", "float16", "min", True, 1, 301, "mst"),
    ("broadcast", "float64", "sum", False, 1, 777, "lp"),
    ("broadcast", "int32", "sum", True, 2, 100, "mst"),
    ("allgather", "float32", "sum", False, 0, 211, "ring"),
    ("reduce_scatter", "float32", "sum", True, 0, 333, "ring"),
    ("reduce_scatter", "int64", "prod", False, 0, 65, "ring"),
    ("gather", "uint8", "sum", False, 1, 97, "linear"),
    ("scatter", "float32", "sum", True, 2, 50, "linear"),
    ("alltoall", "int8", "sum", False, 0, 31, "pairwise"),
    ("allreduce", "float32", "sum", False, 0, 3 * MiB // 4 + 5, "lp"),  # above 2 MiB, chunked
    ("allreduce", "float32", "sum", True, 0, 17 * MiB // 4, "ring"),  # above the cap: not armed
]


def test_forced_algorithms_run_armed_in_their_own_order(tmp_path: Path) -> None:
    """A forced algorithm on one node: its first call runs the host pipeline, which arms
    the schedule compiled into one program; the engine answers the repeats (on), with the
    host pipeline's bits (off: the same schedule on LocalGroup threads) and numpy's. Above
    SCHEDULE_NATIVE_MAX_BYTES it stays on the host pipeline."""
    rng = np.random.default_rng(46)
    cases = []
    for op, dtype, reduce_op, in_place, root, count, _ in FORCED:
        inputs = make_inputs(Collective(op), WORLD, count, DTYPES[dtype], ReduceOp(reduce_op), rng, root)
        cases.append((op, dtype, reduce_op, in_place, root, count, [x.tobytes() for x in inputs]))
    on, off = _on_and_off(tmp_path, cases, [f[-1] for f in FORCED])
    assert on["path"] == "native", on
    armed = sum(
        1 for c in cases if nccl_bytes(c[0], c[5], DTYPES[c[1]].itemsize, WORLD) <= SCHEDULE_NATIVE_MAX_BYTES
    )
    assert armed == len(cases) - 1
    # Calls 3 and 4 of each armed case ring (the first plans, the second arms).
    assert on["answered"] - on["fallbacks"] == 2 * armed, on
    assert off["answered"] == 0, off


@pytest.fixture
def native_daemon(tmp_path: Path):
    daemon = _daemon(tmp_path, "on")
    try:
        yield daemon
    finally:
        daemon.stop_and_check()


def test_mismatch_while_ringing_names_fields(native_daemon) -> None:
    r0, r1 = run_ranks(2, workers.repeat_then, native_daemon.socket, 2, "mm", "mismatch")
    assert r0["armed"] and r1["armed"]
    for r in (r0, r1):
        name, code, message = r["error"]
        assert (name, code) == ("MismatchError", "INVALID_ARGUMENT"), r
        assert "count" in message and "rank 0=16" in message and "rank 1=8" in message
        assert r["seconds"] < 5


def test_rank_that_never_comes_times_out_naming_it(native_daemon) -> None:
    r0, _ = run_ranks(2, workers.repeat_then, native_daemon.socket, 2, "late", "absent", 2.0, timeout=60)
    name, code, message = r0["error"]
    assert (name, code) == ("CollectiveTimeoutError", "DEADLINE_EXCEEDED"), r0
    assert "rank(s) 1 did not arrive" in message
    assert 1.5 < r0["seconds"] < 6.0  # its timeout (2 s), not twice it


def test_rank_that_dies_aborts_the_ringing_one(native_daemon) -> None:
    r0, _ = run_ranks(2, workers.repeat_then, native_daemon.socket, 2, "dies", "die", dies=(1,))
    name, code, message = r0["error"]
    assert (name, code) == ("AbortedError", "ABORTED"), r0
    # The general path's two messages, by whether rank 0's fallback came before or after
    # the daemon saw rank 1 go: "job 'dies' lost rank(s) 1 ..." / "rank 1 of job 'dies' left".
    assert "lost rank(s) 1 " in message or "rank 1 of job 'dies' left" in message, message
    assert r0["seconds"] < 0.5 + 2.0 + 1.0  # rank 1 dies 0.5 s in; ABORTED within 2 s of it


def test_rank_that_dies_while_a_big_program_runs(native_daemon) -> None:
    """32 MiB armed: rank 1 dies just after ringing, while the engine's threads run the
    program (or just before): rank 0's call completes right or fails, and its calls then
    fail ABORTED naming rank 1, within seconds; the daemon stops clean (no shared memory
    left: the plan was disarmed before the rank's buffers were unmapped)."""
    r0, _ = run_ranks(2, workers.big_then_die, native_daemon.socket, 8 * MiB, dies=(1,), timeout=120)
    assert r0["armed"], r0
    assert r0["completed"] <= 1 and r0["wrong"] == 0, r0
    name, code, message = r0["error"]
    assert (name, code) == ("AbortedError", "ABORTED"), r0
    assert "lost rank(s) 1 " in message or "rank 1 of job 'bigdies' left" in message, message
    assert r0["seconds"] < 10.0, r0  # its calls' timeout is 30 s: no call waited for it


def test_released_buffer_disarms_and_the_new_one_sums(native_daemon) -> None:
    r0, r1 = run_ranks(2, workers.repeat_then, native_daemon.socket, 2, "rel", "release")
    assert r0["sum"] == [10.0] * 16 and r1["sum"] == [10.0] * 16
    assert "error" not in r0 and "error" not in r1


def test_killed_daemon_fails_the_ringing_rank(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, "on")
    ctx = helper_context()
    ready = ctx.Queue()
    results = ctx.Queue()

    def run(rank: int) -> mp.Process:
        proc = ctx.Process(target=_report, args=(results, rank, daemon.socket, ready))
        proc.start()
        return proc

    procs = [run(0), run(1)]
    try:
        assert {ready.get(timeout=60), ready.get(timeout=60)} == {0, 1}
        time.sleep(0.5)  # rank 0 rings now
        daemon.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        report = results.get(timeout=30)
        took = time.monotonic() - killed
        assert report["armed"] and report["error"] is not None, report
        assert report["error"][0] in ("UnavailableError", "AbortedError"), report
        assert took < 5.0
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
        daemon.proc.wait(10)
        for name in shm_segments(daemon.pid):  # a killed daemon leaves them: the test cleans up
            Path("/dev/shm", name).unlink(missing_ok=True)


def _report(results, rank: int, socket: str, ready) -> None:
    report = workers.ring_until_killed(rank, socket, ready)
    if rank == 0:
        results.put(report)


def test_status_says_which_path(tmp_path: Path) -> None:
    """`lpsync status` names each job's path; the flight recorder and the metrics count the
    engine's collectives as the Python path's (read at a scrape, not per call)."""
    for native, says in (("on", "native"), ("off", "python (--native off)")):
        (port,) = free_ports(1)
        (tmp_path / native).mkdir()
        daemon = DaemonProcess(tmp_path / native, "--native", native, "--metrics-port", str(port))
        try:
            with lpsync_client.connect(daemon.socket, job="alone", rank=0, world_size=1) as c:
                x = c.zeros(4)
                for _ in range(5):
                    c.allreduce(x)
                # The Python path records a collective just after its reply (off its critical
                # path): both daemons get a moment, the on one for its general-path calls (1,
                # 2: on a loaded machine call 2's record may come after the engine's records of
                # 3-5 were brought in at a Status, and is kept after them); the engine records
                # before it answers.
                deadline = time.monotonic() + 5
                while True:
                    status = c._call(c._stub.Status, pb.StatusRequest(history=10))
                    job = next(j for j in status.jobs if j.job == "alone")
                    if len(job.history) == 5 or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                assert job.path == says
                sequences = [r.sequence for r in job.history]
                # The engine's calls recorded too, in sequence order: call 2's general-path
                # record may be answered after the engine's 3-5 were brought in.
                assert sequences == [1, 2, 3, 4, 5], sequences
                if native == "on":
                    assert job.armed_plans == 1 and job.native_answered == 3
                    last_stage = {r.sequence: r.stages[-1].stage for r in job.history}
                    assert [last_stage[seq] for seq in (3, 4, 5)] == ["native"] * 3, last_stage
                text = cli_status(daemon.socket)
                assert f"path: {says}" in text
                metrics = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                )
                line = next(
                    ln for ln in metrics.splitlines() if ln.startswith("lpsync_collective_seconds_count{")
                )
                assert 'op="allreduce"' in line and line.endswith(" 5.0"), line
                assert 'lpsync_collective_bytes_total{op="allreduce"} 80.0' in metrics
        finally:
            daemon.stop_and_check()
