"""Multi-node collectives on device buffers, hierarchically: the device chain inside each
node, a bounded host ring at the boundary, the peer plane between nodes. Real daemons
(--devices emulated:N) and client processes; results against numpy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tests.daemon.hierarchy_workers as workers
from lpsync.algorithms.registry import algorithms_for
from lpsync.types import Collective
from tests.collective_cases import check_case_results, rotating_cases
from tests.daemon.harness import MemoryPeak, PeeredDaemons, helper_context, run_ranks
from tests.ports import free_ports

HIERARCHICAL = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")
# Large enough not to ride the agreement (64 KiB) in any of these dtypes.
COUNT = 40_000
KINDS = [("float32", "sum"), ("float64", "avg"), ("int32", "max"), ("bfloat16", "sum"), ("float16", "min")]


def _cases(
    world: int, root: int, seed: int, algorithm: str = "", among: tuple[str, ...] = HIERARCHICAL
) -> list[tuple]:
    """The ops ``among`` (those ``algorithm`` offers) in and out of place."""
    ops = [op for op in among if not algorithm or algorithm in algorithms_for(Collective(op))]
    return [c for c in rotating_cases(world, COUNT, KINDS, root=root, seed=seed) if c[0] in ops]


def _run(
    daemons: PeeredDaemons,
    node_of: list[int],
    devices: list[int],
    cases: list[tuple],
    algorithm: str,
    store: int = 0,
):
    world = len(node_of)
    args = (daemons.sockets, node_of, devices, cases, algorithm, store)
    return run_ranks(world, workers.cases_on_nodes, *args, timeout=180)


DIRECT = ("--peer-device-path", "device")  # emulated memory is host memory: any transport carries it


@pytest.mark.parametrize("path", ["staged", "direct"])
@pytest.mark.parametrize("algorithm", ["lp", "ring", "be"])
def test_two_nodes_two_devices_each(tmp_path: Path, algorithm: str, path: str) -> None:
    """Two ranks per node on two emulated devices; 16 KiB segments, so every message
    crosses in several rounds: through the ring (64 KiB of staging, 4 slots), or from the
    boundary's device memory, reduced on its stream (the direct path a CUDA-aware UCX gets)."""
    flags = DIRECT if path == "direct" else ()
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", "65536", *flags)
    try:
        if path == "direct":
            assert "asked for (--peer-device-path device)" in daemons.log(0)
        node_of, devices = [0, 0, 1, 1], [0, 1, 1, 0]
        cases = _cases(4, root=3, seed=21 if path == "staged" else 41, algorithm=algorithm)
        check_case_results(cases, _run(daemons, node_of, devices, cases, algorithm), 4)
    finally:
        daemons.stop_and_check()


def test_gather_scatter_alltoall_in_packed_segments(tmp_path: Path) -> None:
    """Gather, scatter and alltoall (linear, linear, pairwise: their only schedules) on
    device buffers across two daemons of two devices each: every rank in one pipeline over
    packed segments (64 KiB of staging: each message in several rounds through the ring),
    against numpy."""
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", "65536")
    try:
        node_of, devices = [0, 0, 1, 1], [0, 1, 1, 0]
        cases = _cases(4, root=1, seed=23, among=("gather", "scatter", "alltoall"))
        check_case_results(cases, _run(daemons, node_of, devices, cases, ""), 4)
    finally:
        daemons.stop_and_check()


@pytest.mark.parametrize("path", ["staged", "mixed"])
def test_three_nodes_of_unequal_size(tmp_path: Path, path: str) -> None:
    """Nodes of 2, 1 and 2 ranks, the tuner's choice, roots on the one-rank node and on a
    node's second rank: a non-root node's boundary keeps its partial sum off the buffers.
    Mixed: nodes 0 and 2 send from device memory, node 1 stages through its ring, in one
    pipeline (each node decides its own side: segments, schedules and tags are the same)."""
    per_node = [DIRECT, (), DIRECT] if path == "mixed" else None
    daemons = PeeredDaemons(
        tmp_path, 3, "--devices", "emulated:2", "--device-staging-bytes", "131072", per_node=per_node
    )
    try:
        node_of, devices = [0, 0, 1, 2, 2], [0, 1, 0, 1, 0]
        for root, seed in ((2, 31), (4, 32)):
            cases = _cases(5, root=root, seed=seed)
            store = free_ports(1)[0]
            check_case_results(cases, _run(daemons, node_of, devices, cases, "", store), 5)
    finally:
        daemons.stop_and_check()


def _host_growth_kib(daemons: PeeredDaemons, count: int) -> list[int]:
    """Each daemon's peak growth of anonymous host memory (KiB) while two nodes of two ranks
    run one allreduce of ``count`` float32 on device buffers (checked), after a warm-up
    (streams, threads, plans' pools). The host ring is anonymous memory; emulated device
    memory is a memfd, apart."""
    node_of = [0, 0, 1, 1]
    assert all(r["ok"] for r in run_ranks(4, workers.big_allreduce, daemons.sockets, node_of, 1 << 16))
    pids = [d.pid for d in daemons.daemons if d is not None]
    with MemoryPeak(pids, "RssAnon") as memory:
        results = run_ranks(4, workers.big_allreduce, daemons.sockets, node_of, count, timeout=600)
    assert all(r["ok"] for r in results)
    return memory.growth_kib


def test_host_memory_stays_within_the_staging_bound(tmp_path: Path) -> None:
    """A 256 MiB allreduce on device buffers, two nodes of two ranks: each daemon's host
    memory grows by at most its staging bound (16 MiB) plus slack, where staging whole
    buffers would take 512 MiB per daemon."""
    bound = 16 << 20
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", str(bound))
    try:
        slack = 48 << 10  # KiB: the interpreter, receive windows, allocator noise
        for grown in _host_growth_kib(daemons, 64 << 20):
            assert grown <= (bound >> 10) + slack, f"host memory grew by {grown >> 10} MiB"
    finally:
        daemons.stop_and_check()


def test_the_direct_path_holds_no_host_ring(tmp_path: Path) -> None:
    """With 64 MiB of staging allowed, a 64 MiB allreduce on device buffers: a staged
    daemon's host memory grows by its ring (measured beside it), a direct one's does not."""
    bound = 64 << 20
    per_node = [DIRECT, ()]
    daemons = PeeredDaemons(
        tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", str(bound), per_node=per_node
    )
    try:
        direct, staged = _host_growth_kib(daemons, 16 << 20)
        assert staged >= (bound >> 10) // 2, f"the staged daemon grew by {staged >> 10} MiB only"
        assert direct <= 16 << 10, f"the direct daemon's host memory grew by {direct >> 10} MiB"
    finally:
        daemons.stop_and_check()


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_a_peer_daemon_killed_mid_collective_fails_it_and_leaks_nothing(tmp_path: Path, path: str) -> None:
    """Node 1's daemon is killed while an 8 MB allreduce crosses the nodes (slow emulated
    copies, 256 KiB segments; through the ring, or from device memory): node 0's ranks get
    UnavailableError instead of hanging, node 0 closes every IPC mapping once its streams
    drained, keeps no extra threads, and serves a correct hierarchical allreduce with node 1
    once it is back."""

    from tests.daemon.test_daemon_devices import _device_rows, _threads

    flags = DIRECT if path == "direct" else ()
    daemons = PeeredDaemons(
        tmp_path, 2, "--devices", "emulated:2,bw=20000000", "--device-staging-bytes", str(1 << 20), *flags
    )
    try:
        node_of = [0, 0, 1, 1]
        assert all(r["ok"] for r in run_ranks(4, workers.big_allreduce, daemons.sockets, node_of, 1 << 16))
        node0 = daemons.daemons[0]
        assert node0 is not None
        before = _threads(node0.pid)
        ready = tmp_path / "submitted"
        ctx = helper_context()
        ranks = [
            ctx.Process(target=workers.allreduce_until_lost, args=(r, daemons.sockets, node_of, str(ready)))
            for r in range(4)
        ]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 0 did not submit"
            time.sleep(0.02)
        time.sleep(0.3)  # segments on the wire and on the streams
        node1 = daemons.daemons[1]
        assert node1 is not None
        node1.proc.kill()
        for p in ranks:
            p.join(120)
            assert p.exitcode is not None, "a rank hung"
        outcomes = [Path(f"{ready}.rank{r}").read_text() for r in range(2)]
        assert outcomes == ["UnavailableError"] * 2, outcomes  # node 0's ranks
        deadline = time.monotonic() + 60
        while any(r.open_allocations for r in _device_rows(node0.socket).values()):
            assert time.monotonic() < deadline, "allocations stayed open after the drain"
            time.sleep(0.1)
        now_total, now_streams = _threads(node0.pid)
        assert now_streams == before[1], "stream threads leaked"
        assert now_total <= before[0] + 4, "daemon threads leaked"
        daemons.start(1)
        results = run_ranks(4, workers.big_allreduce, daemons.sockets, node_of, 1 << 20, timeout=180)
        assert all(r["ok"] for r in results)
    finally:
        daemons.stop_and_check()


def test_point_to_point_on_device_buffers_across_nodes(tmp_path: Path) -> None:
    """send/recv of emulated device arrays in a ring over two daemons (a message is a
    broadcast in a two-rank job: across nodes it takes the hierarchy's ring)."""
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", "65536")
    try:
        node_of = [0, 0, 1, 1]
        results = run_ranks(4, workers.device_ring_messages, daemons.sockets, node_of, 100_000)
        assert results == [[float((r - 1) % 4 + 1)] * 2 for r in range(4)]
    finally:
        daemons.stop_and_check()


def test_a_plan_closed_during_its_run_closes_when_the_run_ends() -> None:
    """The segment plans (hierarchy.py, packed.py) outlive a close that comes mid-run (a
    client that died ended its job's plans): its later segments still run, the close
    follows the run's end; closed at once when idle. Before, the next segment failed on a
    shut-down pool and the other nodes waited out their timeout."""
    from lpsync.daemon.collectives.plans import ClosedWhenIdle

    class Plan(ClosedWhenIdle):
        def __init__(self) -> None:
            super().__init__()
            self.closed: list[bool] = []

        def _close(self, wait: bool) -> None:
            self.closed.append(wait)

    plan = Plan()
    plan.acquire()
    plan.close(wait=False)
    assert plan.closed == []  # the run goes on
    plan.release()
    assert plan.closed == [False]
    idle = Plan()
    idle.close()
    assert idle.closed == [True]
