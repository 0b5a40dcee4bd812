"""``lpsync bench --cluster``: argument errors without root; with root, a real 3-node
emulated cluster (3 daemons joined by UCX over shaped links, 2 client processes per node,
gloo beside them) whose results are checked against numpy, and nothing left behind —
after a run, a killed rank, Ctrl-C and SIGTERM."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lpsync.bench.cluster import ClusterOptions, _cpu_text
from lpsync.bench.cluster_report import STAGES, Point, emit, key, label, scaling, table
from lpsync.bench.cluster_worker import measure
from lpsync.bench.cpu import CpuMeter, context_switches, cpu_seconds, machine_busy_seconds
from lpsync.cli import main
from lpsync.cluster import existing
from lpsync.errors import LpsyncError
from tests.cluster.test_cluster import needs_netns, prefix

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"op", "algorithm", "nodes", "bytes", "seconds", "wire_seconds"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "1"], "2 or more nodes"),
        (["--nodes", "2,x"], "--nodes must be a comma list"),
        (["--nodes", "300"], "1..254"),
        (["--nodes", ""], "--cluster needs --nodes"),
        (["--link", "fast"], "cannot read link rate"),
        (["--procs-per-node", "0"], "--procs-per-node must be >= 1"),
        (["--op", "gatter"], "--op gatter"),
        (["--op", "broadcast", "--algorithm", "ring"], "runs none of the ops"),
        (["--algorithm", "direct"], "runs none of the ops"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--bytes", "2"], "sizes must be >= 4"),
        (["--bytes", "lots"], "cannot read 'lots'"),
        (["--procs", "4"], "--procs-per-node"),
        (["--prefix", "Bad-Name"], "--prefix"),
        (["--peer-transport", "quic"], "unknown peer transport 'quic'"),
    ],
)
def test_bad_cluster_arguments(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--nodes": "2,8", "--link": "1gbit", "--op": "broadcast", "--bytes": "64MiB"}
    base.update(zip(flags[::2], flags[1::2], strict=True))
    argv = ["bench", "--cluster"]
    for flag, value in base.items():
        argv += [flag, value] if value else []
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cluster_flags_need_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--nodes", "2", "--link", "1gbit"]) == 2
    assert "need --cluster" in capsys.readouterr().err
    assert main(["bench", "--op", "broadcast,reduce"]) == 2
    assert "comma lists need --cluster" in capsys.readouterr().err
    assert main(["bench", "--algorithm", "lp,ring"]) == 2
    assert "one algorithm (comma lists need --cluster)" in capsys.readouterr().err


def test_not_root_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "--cluster", "--nodes", "2", "--link", "1gbit"]) == 1
    assert "need root" in capsys.readouterr().err


def test_plan_skips_algorithms_an_op_lacks() -> None:
    options = ClusterOptions(
        (2,), 10**9, ("broadcast", "allreduce"), ("lp", "ring", "auto"), (1 << 20,), compare="gloo"
    )
    assert options.plan(2)["algorithms"] == {"broadcast": ["lp", "auto"], "allreduce": ["lp", "ring", "auto"]}
    assert options.skipped() == ["ring has no broadcast"]
    assert options.points_per_cluster() == 2 + 3 + 2  # and one gloo row per op


def test_iterations_go_by_size_unless_forced() -> None:
    """A 4-byte point takes milliseconds: five calls would leave its median to chance. So
    200 up to 1 MiB, fewer above, 5 from 64 MiB (seconds a call); --iters forces one count."""
    sizes = (4, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)
    by_size = ClusterOptions((2,), 10**9, ("allreduce",), ("auto",), sizes)
    assert by_size.plan(2)["iters"] == {
        "4": 200,
        str(64 << 10): 200,
        str(1 << 20): 200,
        str(16 << 20): 20,
        str(64 << 20): 5,
        str(256 << 20): 5,
    }
    assert by_size.flight_recorder() >= 3 * 200  # every timed call's record and its barrier's
    forced = ClusterOptions((2,), 10**9, ("allreduce",), ("auto",), sizes, iters=7)
    assert set(forced.plan(2)["iters"].values()) == {7} and forced.plan(2)["steps"] == 7
    assert by_size.plan(2)["steps"] == 5  # --model's timed steps


def test_the_header_says_each_size_s_iterations() -> None:
    points = [
        Point("allreduce", "auto", "ring", 8, 1, 10**9, n, n // 4, [0.01] * iters)
        for n, iters in ((4, 200), (64 << 20, 5))
    ]
    assert "median of (4B: 200, 64MiB: 5) iterations" in table(points)
    same = [Point("allreduce", "auto", "ring", 8, 1, 10**9, n, n // 4, [0.01] * 5) for n in (4, 8)]
    assert "median of 5 iterations" in table(same)


def test_report_has_the_wire_limit_and_ratios() -> None:
    points = [
        Point("broadcast", a, a, n, 1, 10**9, 64 << 20, 16 << 20, [t, t * 1.1, t * 0.9])
        for n, a, t in ((2, "lp", 0.56), (2, "be", 0.6), (8, "lp", 0.75), (8, "be", 1.45))
    ]
    wire = (64 << 20) / 1.25e8
    assert points[0].seconds == pytest.approx(0.56)
    assert points[0].to_json()["x_wire"] == pytest.approx(0.56 / wire)
    assert set(points[0].to_json()) >= KEYS
    text = table(points)
    assert "x wire" in text and f"{wire * 1e6:.1f}" in text
    assert "1.93x be" in text  # lp's time against be's at 8 nodes
    assert any("2 nodes 0.5600 s, 8 nodes 0.7500 s (1.34x)" in line for line in scaling(points))


def test_points_of_another_transport_are_labelled_and_kept_apart() -> None:
    ucx, tcp = (Point("broadcast", "lp", "lp", 8, 1, 10**9, 64 << 20, 16 << 20, [t]) for t in (0.70, 0.63))
    tcp.transport = "tcp"
    assert label(ucx) == "lp" and label(tcp) == "lp@tcp" and key(ucx) != key(tcp)
    assert tcp.to_json()["transport"] == "tcp"
    assert "0.90x lp@tcp" in table([ucx, tcp])  # lp@tcp against lp (ucx), one block


def _record(sequence: int, **stages: float) -> dict:
    return {"sequence": sequence, "total": sum(stages.values()), "stages": stages}


def test_cpu_per_gb_and_the_fixed_cost_of_the_median_iteration() -> None:
    # 3 iterations; node 1's daemon took longest in each. The median iteration is #2.
    records = {
        0: [_record(7, arriving=0.0, queued=1e-5, agreeing=2e-4, running=3e-4)] * 3,
        1: [
            _record(7, arriving=0.0, queued=2e-5, agreeing=3e-4, running=5e-4),
            _record(9, arriving=1e-5, queued=2e-5, agreeing=4e-4, running=9e-4),
            _record(11, arriving=0.0, queued=3e-5, agreeing=5e-4, running=6e-4),
        ],
    }
    cpu = {"rank": 0.05, "daemon": 0.03, "rank_barriers": 0.01, "daemon_barriers": 0.01}
    p = Point("broadcast", "lp", "lp", 2, 1, 10**9, 1 << 20, 1 << 18, [1.5e-3, 2e-3, 1.8e-3], 0, cpu, records)
    assert p.cpu_seconds() == pytest.approx(0.06)
    assert p.cpu_per_gb() == pytest.approx(0.06 / (3 * (1 << 20) / 1e9))
    fixed = p.fixed_cost()
    assert fixed is not None and fixed.iteration == 2 and fixed.node == 1
    assert list(fixed.stages) == list(STAGES)
    assert fixed.stages["agreeing"] == pytest.approx(5e-4)
    assert fixed.daemon == pytest.approx(sum(fixed.stages.values()))
    assert fixed.client == pytest.approx(1.8e-3 - fixed.daemon)
    # Over all iterations, each stage's median in the daemon that took longest.
    assert fixed.medians == pytest.approx(
        {"arriving": 0.0, "queued": 2e-5, "agreeing": 4e-4, "running": 6e-4}
    )
    assert fixed.summary() == "arriving 0, queued 30, agreeing 500, running 600, client 670 us"
    row = p.to_json()
    assert row["cpu_s_per_gb"] == pytest.approx(p.cpu_per_gb())
    assert row["fixed_cost"]["stages"]["running"] == pytest.approx(6e-4)
    text = table([p])
    assert f"{p.cpu_per_gb():.4g}" in text and "(s/GB)" in text
    assert "fixed cost of the median iteration" in text
    assert re.search(r"1048576 +lp +1 \| +1800\.0 \| +0\.0 +30\.0 +500\.0 +600\.0 \| +670\.0", text), text
    # A missing record (or gloo, which has none) gives no fixed cost rather than a wrong one.
    assert (
        Point(
            "broadcast",
            "lp",
            "lp",
            2,
            1,
            10**9,
            4,
            1,
            [1.0, 2.0],
            0,
            cpu,
            {0: records[0][:2], 1: records[1][:1]},
        ).fixed_cost()
        is None
    )
    # Context switches per call and process, the barriers' taken out; none where a run
    # did not count them (an older JSON line).
    counted = dict(
        cpu, daemon_switches=1000, daemon_switches_barriers=400, rank_switches=90, rank_switches_barriers=30
    )
    q = Point("broadcast", "lp", "lp", 2, 1, 10**9, 1 << 20, 1 << 18, [1.5e-3, 2e-3, 1.8e-3], 0, counted)
    assert q.switches_per_call("daemon") == pytest.approx(600 / 2 / 3)
    assert q.switches_per_call("rank") == pytest.approx(60 / 2 / 3)
    assert q.to_json()["daemon_switches_per_call"] == pytest.approx(100.0)
    assert re.search(r"\| +1800\.0 +\S+ +\S+ +\S+ +\S+ +100\.0 +10\.0 ", table([q])), table([q])
    assert "dsw/rsw = their context switches per call" in table([q])
    assert p.switches_per_call("daemon") is None and p.to_json()["rank_switches_per_call"] is None
    # Each daemon apart (node 0 judges and answers every other node, so the mean hides it):
    # per call in the JSON, in node order, and its range in the progress line.
    r = Point("allreduce", "auto", "tree", 2, 1, 10**9, 4, 1, [1e-3] * 3, 0, cpu, {}, {1: 0.003, 0: 0.009})
    assert r.to_json()["daemon_cpu_us_per_call_by_node"] == pytest.approx([3000.0, 1000.0])
    assert "daemons 1000-3000 us/call (most: node 0)" in _cpu_text(r)
    assert p.to_json()["daemon_cpu_us_per_call_by_node"] == [] and "daemons" not in _cpu_text(p)
    alone = Point("allreduce", "auto", "direct", 1, 2, 10**9, 4, 1, [1e-3], 0, cpu, {}, {0: 0.001})
    assert alone.to_json()["daemon_cpu_us_per_call_by_node"] == pytest.approx([1000.0])
    assert "daemons" not in _cpu_text(alone)  # one daemon: the mean is it
    # The barriers alone cost more than the loop (tiny messages, noise): 0, never negative.
    noisy = dict(cpu, rank_barriers=0.2)
    assert Point("allreduce", "lp", "lp", 2, 1, 10**9, 4, 1, [1.0], 0, noisy).cpu_seconds() == 0


def test_flat_in_p_column_against_the_fewest_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    def point(nodes: int, seconds: float) -> Point:
        return Point("reduce", "lp", "lp", nodes, 1, 2 * 10**8, 64 << 20, 16 << 20, [seconds])

    show = emit(as_json=False)
    show([point(2, 2.8)])
    assert "vs 2n" not in capsys.readouterr().out  # nothing to compare with yet
    show([point(4, 2.94)])
    out = capsys.readouterr().out
    assert "vs 2n" in out and re.search(r" 1\.05$", out.splitlines()[3]), out
    show = emit(as_json=True)
    show([point(2, 2.8)])
    assert "x_vs_nodes" not in json.loads(capsys.readouterr().out)
    show([point(16, 3.08)])
    row = json.loads(capsys.readouterr().out)
    assert row["vs_nodes"] == 2 and row["x_vs_nodes"] == pytest.approx(1.1)
    lines = scaling([point(2, 2.8), point(4, 2.94), point(16, 3.08)])
    assert lines == [
        "# reduce lp 64MiB: 2 nodes 2.8000 s, 4 nodes 2.9400 s (1.05x), 16 nodes 3.0800 s (1.10x)"
    ]


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_measure_counts_the_calls_cpu_apart_from_the_barriers() -> None:
    # The call burns 20 ms of CPU, each barrier 5 ms: over 4 iterations the loop holds
    # 80 + 25 ms and the barriers alone 25 ms.
    got = measure(lambda: _burn(0.02), lambda: _burn(0.005), warmup=1, iters=4)
    assert len(got.times) == 4 and all(t >= 0.019 for t in got.times)
    assert got.cpu["rank"] == pytest.approx(0.105, abs=0.015)
    assert got.cpu["rank"] - got.cpu["rank_barriers"] == pytest.approx(0.08, abs=0.015)
    assert got.cpu["daemon"] == 0 == got.cpu["daemon_barriers"]  # no daemon pid
    assert got.cpu["machine"] == 0 == got.cpu["machine_barriers"]  # not asked for
    assert got.window[0] < got.window[1]
    assert got.cpu["daemon_switches"] == 0 == got.cpu["daemon_switches_barriers"]


def test_measure_counts_the_calls_context_switches() -> None:
    # Each sleep is a switch at least (preemptions on a loaded machine add more, anywhere):
    # the call sleeps 5 times and each barrier once, so the loop (4 calls, 5 barriers)
    # holds at least 25 and the barriers alone (5) at least 5.
    def call() -> None:
        for _ in range(5):
            time.sleep(0.001)

    got = measure(call, lambda: time.sleep(0.001), warmup=1, iters=4)
    assert got.cpu["rank_switches"] >= 4 * 5 + 5
    assert got.cpu["rank_switches_barriers"] >= 5
    assert got.cpu["rank_switches_barriers"] < got.cpu["rank_switches"]


def test_the_machine_meter_reads_every_busy_cpu_field_but_idle_iowait_and_steal(tmp_path: Path) -> None:
    # proc(5): user nice system idle iowait irq softirq steal guest guest_nice, in ticks.
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 2 30 5000 40 6 70 900 11 0\ncpu0 50 1 15 2500 20 3 35 450 5 0\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert machine_busy_seconds(str(stat)) == pytest.approx((100 + 2 + 30 + 6 + 70) / ticks)


def test_the_machine_meter_sees_another_process_burn() -> None:
    # What a child burns shows on the machine's clock (its ticks: 10 ms each, and
    # whatever else the machine did meanwhile on top).
    before = CpuMeter(machine=True).read()[2]
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\ne = time.process_time() + 0.5\nwhile time.process_time() < e: pass",
        ],
        check=True,
    )
    assert CpuMeter(machine=True).read()[2] - before >= 0.4


@contextlib.contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child running ``code``, its stdin and stdout piped; killed if still running
    at the end (the test closes its stdin to let it finish)."""
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_cpu_meter_reads_another_process_and_fails_once_it_is_gone() -> None:
    code = (
        "import time\ne = time.process_time() + 0.3\nwhile time.process_time() < e: pass\n"
        "print(time.process_time(), flush=True)\ninput()"
    )
    with _child(code) as child:
        own = float(child.stdout.readline())  # what the child counted itself
        seen = CpuMeter(child.pid).read()[1]
        assert own <= seen < own + 0.1  # + its exit path so far; blocked in input() now
        assert cpu_seconds(os.getpid()) > 0
        child.stdin.close()
        child.wait(10)
    with pytest.raises(LpsyncError, match=f"CPU time of process {child.pid}"):
        cpu_seconds(child.pid)


def test_context_switches_of_another_process_count_its_sleeps_and_fail_once_it_is_gone() -> None:
    code = "import time\nfor _ in range(50): time.sleep(0.002)\nprint('slept', flush=True)\ninput()"
    with _child(code) as child:
        assert child.stdout.readline().strip() == "slept"
        assert context_switches(child.pid) >= 50  # each sleep is one, at least
        assert CpuMeter(child.pid).read()[4] == context_switches(child.pid)  # blocked in input()
        mine = context_switches(os.getpid())
        time.sleep(0.01)
        assert context_switches(os.getpid()) > mine
        child.stdin.close()
        child.wait(10)
    with pytest.raises(LpsyncError, match=f"threads of process {child.pid}"):
        context_switches(child.pid)


def _leftovers(name: str, daemon_pids: list[int]) -> list[str]:
    """Anything of run ``name`` still on the machine: namespaces, processes (found by the
    prefix in their command line: the daemons' socket paths, the ranks' job name),
    shared memory of its daemons, its temporary directory."""
    found = [f"namespace {n}" for n in existing(name)]
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            text = Path(cmdline).read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"lpsync-bench-{name}-" in text or f'"job": "{name}-' in text:
            found.append(f"process {cmdline.split('/')[2]}: {text[:120]}")
    found += [f"shm {p}" for pid in daemon_pids for p in glob.glob(f"/dev/shm/lpsync-{pid}-*")]
    found += glob.glob(f"/tmp/lpsync-bench-{name}-*")
    return found


def _daemon_pids(stderr: str) -> list[int]:
    return [
        int(p)
        for group in re.findall(r"daemons serving \(pids ([0-9, ]+)\)", stderr)
        for p in group.split(", ")
    ]


@needs_netns
def test_three_node_cluster_bench_end_to_end() -> None:
    pytest.importorskip("ucxx")
    pytest.importorskip("torch")
    name = prefix("cb")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--cluster",
            "--nodes",
            "3",
            "--link",
            "1gbit",
            "--procs-per-node",
            "2",
            "--op",
            "broadcast,reduce,allreduce,gather,scatter,alltoall",
            "--algorithm",
            "lp,be,ring,auto",
            "--bytes",
            "256KiB,100004",
            "--iters",
            "2",
            "--compare",
            "gloo",
            "--prefix",
            name,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    points = [json.loads(line) for line in done.stdout.splitlines()]
    expected = {
        (op, a, n)
        for op in ("broadcast", "reduce", "allreduce")
        for a in ("lp", "be", "auto", "gloo")
        for n in (262144, 100004)
    }
    expected |= {("allreduce", "ring", n) for n in (262144, 100004)}
    # gather, scatter and alltoall have none of lp, be, ring: the tuner's pick and gloo
    expected |= {
        (op, a, n)
        for op in ("gather", "scatter", "alltoall")
        for a in ("auto", "gloo")
        for n in (262144, 100004)
    }
    assert {(p["op"], p["algorithm"], p["bytes"]) for p in points} == expected
    assert "skipped: ring has no broadcast" in done.stderr
    assert "skipped: lp has no alltoall" in done.stderr
    for p in points:
        assert set(p) >= KEYS, p
        assert p["wrong"] == 0, p
        assert p["nodes"] == 3 and p["ranks"] == 6 and p["iterations"] == 2
        assert 0 < p["seconds"] < 30 and p["wire_seconds"] == pytest.approx(p["bytes"] / 1.25e8)
        # The daemon ran what was forced; auto reports the tuner's pick.
        assert p["ran"] == p["algorithm"] or (
            p["algorithm"] == "auto" and p["ran"] in ("lp", "ring", "be", "mst", "linear", "pairwise")
        )
        # CPU: every rank's, and for lpsync every daemon's; at most what 2 iterations' wall
        # time on every core could hold (+ the barriers' own time, generously). The calls'
        # CPU is the whole processes' less their 3 barriers': on a loaded box one point's
        # 2 calls can cost less than that noise (then 0, never negative), so only the run's
        # lpsync points together must show some (below).
        assert p["cpu"]["rank"] > 0 and (p["cpu"]["daemon"] > 0) == (p["algorithm"] != "gloo")
        assert 0 <= p["cpu_seconds"] < (os.cpu_count() or 1) * (sum(p["times"]) + 2.0)
        assert p["cpu_s_per_gb"] == pytest.approx(p["cpu_seconds"] / (2 * p["bytes"] / 1e9))
        # The machine's busy time, read by rank 0 over the same spans (both engines).
        machine = max(0.0, p["cpu"]["machine"] - p["cpu"]["machine_barriers"])
        assert 0 <= p["cpu"]["machine"] < (os.cpu_count() or 1) * (sum(p["times"]) + 2.0)
        assert p["machine_cpu_s_per_gb"] == pytest.approx(machine / (2 * p["bytes"] / 1e9))
        # Per call and process: the daemons' mean (none for gloo) and the ranks' mean.
        ranks, calls = p["nodes"] * p["procs_per_node"], len(p["times"])
        rank_us = max(0.0, p["cpu"]["rank"] - p["cpu"]["rank_barriers"]) / ranks / calls * 1e6
        assert p["rank_cpu_us_per_call"] == pytest.approx(rank_us)
        if p["algorithm"] == "gloo":
            assert p["daemon_cpu_us_per_call"] is None
        else:
            daemon_us = max(0.0, p["cpu"]["daemon"] - p["cpu"]["daemon_barriers"]) / p["nodes"] / calls * 1e6
            assert p["daemon_cpu_us_per_call"] == pytest.approx(daemon_us)
            # Each node's daemon apart, in node order: their mean is the mean daemon's
            # (each node's share is clipped at 0 on its own, so never below it).
            by_node = p["daemon_cpu_us_per_call_by_node"]
            assert len(by_node) == p["nodes"] and min(by_node) >= 0, p
            if min(by_node) > 0:
                assert sum(by_node) / p["nodes"] == pytest.approx(daemon_us)
            assert sum(by_node) / p["nodes"] >= daemon_us - 1e-6
            # A daemon sleeps and wakes at least once per call (the request comes in).
            assert p["cpu"]["daemon_switches"] >= p["nodes"] * calls
        # Every rank blocks on each call's reply and each barrier: switches, counted.
        assert p["cpu"]["rank_switches"] >= ranks * calls
        rank_sw = max(0, p["cpu"]["rank_switches"] - p["cpu"]["rank_switches_barriers"]) / ranks / calls
        assert p["rank_switches_per_call"] == pytest.approx(rank_sw)
        fixed = p["fixed_cost"]
        if p["algorithm"] == "gloo":
            assert fixed is None
            continue
        # One flight record per node and iteration: the stages of a cross-node collective,
        # each plausible, summing to the daemon's total, within the iteration's time.
        assert fixed is not None, p
        # The general path's stages, or an armed call's (its plan ran twice before: the
        # bench's warm-up and first iteration).
        assert list(fixed["stages"]) in (
            ["arriving", "queued", "agreeing", "running"],
            ["arriving", "native"],
        )
        assert all(0 <= s < 30 for s in fixed["stages"].values()), fixed
        assert sum(fixed["stages"].values()) == pytest.approx(fixed["daemon_seconds"])
        assert fixed["seconds"] in p["times"] and 0 <= fixed["node"] < 3
        assert list(fixed["stage_medians"]) == list(fixed["stages"])
        assert all(0 <= s < 30 for s in fixed["stage_medians"].values()), fixed
        assert 0 < fixed["daemon_seconds"] <= fixed["seconds"] + 1e-3  # reply before record
    assert sum(p["cpu_seconds"] for p in points if p["algorithm"] != "gloo") > 0
    pids = _daemon_pids(done.stderr)
    assert len(pids) == 3
    assert _leftovers(name, pids) == []


@needs_netns
def test_both_peer_transports_in_one_run() -> None:
    """--peer-transport ucx,tcp: every lpsync point on each transport, each on a fresh
    cluster, results checked against numpy in the workers; gloo once."""
    pytest.importorskip("ucxx")
    pytest.importorskip("torch")
    name = prefix("tr")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--cluster",
            "--nodes",
            "2",
            "--link",
            "1gbit",
            "--op",
            "allreduce",
            "--algorithm",
            "ring,auto",
            "--bytes",
            "4,1MiB",
            "--iters",
            "2",
            "--peer-transport",
            "ucx,tcp",
            "--compare",
            "gloo",
            "--prefix",
            name,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    points = [json.loads(line) for line in done.stdout.splitlines()]
    got = sorted((p["transport"], p["algorithm"], p["bytes"]) for p in points)
    want = [(t, a, n) for t in ("ucx", "tcp") for a in ("ring", "auto") for n in (4, 1 << 20)]
    assert got == sorted([*want, ("ucx", "gloo", 4), ("ucx", "gloo", 1 << 20)])
    assert all(p["wrong"] == 0 for p in points), points
    assert "peer transport tcp" in done.stderr
    pids = _daemon_pids(done.stderr)
    assert len(pids) == 4  # two clusters of two
    assert _leftovers(name, pids) == []


def _interrupt_a_long_run(name: str, act) -> tuple[int, str, str]:
    """Start a 2-node run that would take minutes, ``act()`` once its ranks are started;
    the exit code, the stderr up to then and after."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--cluster",
            "--nodes",
            "2",
            "--link",
            "1gbit",
            "--op",
            "allreduce",
            "--algorithm",
            "lp",
            "--bytes",
            "64MiB",
            "--iters",
            "1000",
            "--prefix",
            name,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "starting 2 ranks" in line:
                break
        assert existing(name), "".join(lines)
        act(proc)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines), rest


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_run_tears_everything_down(sig: signal.Signals) -> None:
    pytest.importorskip("ucxx")
    name = prefix("ci")
    rc, before, after = _interrupt_a_long_run(name, lambda p: p.send_signal(sig))
    assert rc == 130, before + after
    assert "torn down" in after
    assert _leftovers(name, _daemon_pids(before)) == []


@needs_netns
def test_a_failed_rank_tears_everything_down() -> None:
    pytest.importorskip("ucxx")
    name = prefix("cf")

    def kill_rank_1(_: subprocess.Popen[str]) -> None:
        for _attempt in range(100):  # the rank may still be importing
            for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
                with contextlib.suppress(OSError):
                    environ = Path(cmdline).with_name("environ").read_text().split("\0")
                    if f'"job": "{name}-' in Path(cmdline).read_text() and "RANK=1" in environ:
                        os.kill(int(cmdline.split("/")[2]), signal.SIGKILL)
                        return
            time.sleep(0.1)
        raise AssertionError("rank 1 never showed up")

    rc, before, after = _interrupt_a_long_run(name, kill_rank_1)
    assert rc == 1, before + after
    assert "rank 1 (node 1) failed with exit code -9" in after, after
    assert _leftovers(name, _daemon_pids(before)) == []
