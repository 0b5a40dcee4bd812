"""Device buffers on a real GPU through CUDA IPC (marker ``gpu``; scripts/gpu_check.sh).

Skipped, with the reason, where cupy or a GPU is missing. The same orchestration runs in
CI on the emulated device (test_daemon_devices.py); these check the cupy mapping itself.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

import lpsync_client
import tests.daemon.device_workers as device_workers
from lpsync.types import DTYPES
from tests.collective_cases import check_case_results, every_case, rotating_cases
from tests.daemon.harness import DaemonProcess, MemoryPeak, PeeredDaemons, run_ranks


def _no_gpu() -> str:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'lpsync[cuda12]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as error:  # no driver, no device
        return f"no usable CUDA device: {error}"
    return ""


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_no_gpu()), reason=_no_gpu() or "-")]


@pytest.fixture
def gpu_daemon(tmp_path: Path):
    proc = DaemonProcess(tmp_path, "--devices", "cuda:0")
    try:
        yield proc
    finally:
        proc.stop_and_check()


def _rows(socket: str):
    with lpsync_client.connect(socket, job="status", rank=0, world_size=1) as client:
        return {d.index: d for d in client.status().devices}


def test_every_op_dtype_through_cuda_ipc_with_processes_sharing_a_gpu(gpu_daemon):
    world, count = 3, 4099
    cases = every_case(world, count, root=2, seed=11)
    if "bfloat16" in DTYPES:
        pytest.importorskip("torch")  # cupy has no bfloat16: those arrays come from torch
    results = run_ranks(
        world, device_workers.run_cases, gpu_daemon.socket, world, [0, 0, 0], cases, "cupy", timeout=400
    )
    check_case_results(cases, results, world)
    row = _rows(gpu_daemon.socket)[0]
    assert row.open_allocations == 0 and row.ipc_opens == row.ipc_closes > 0


def test_collective_is_ordered_after_the_current_stream(gpu_daemon):
    results = run_ranks(3, device_workers.cupy_ordered_after_stream, gpu_daemon.socket, 3)
    assert all(values == [6.0, 6.0, 6.0] for values in results)


def test_frameworks_register_device_memory(gpu_daemon):
    (seen,) = run_ranks(1, device_workers.frameworks_register, gpu_daemon.socket)
    if "cupy" in seen:
        assert seen["cupy"] == [0.0, 1.0, 2.0]
    if "torch" in seen:
        assert seen["torch"] == [1000.0, 1001.0, 1002.0]
    if "jax" in seen:  # JAX's GPU memory may not be exportable: then refused by name
        assert seen["jax"] == [0.0, 2.0, 4.0] or "cannot be exported" in seen["jax"], seen["jax"]
    assert {"cupy", "torch", "jax"} & set(seen), "no CUDA framework installed"


def test_framework_adapters_take_the_device_path(gpu_daemon):
    """torch, cupy (and jax with a GPU) adapters reduce CUDA memory in place through IPC:
    registrations exist, so nothing was staged through host memory."""
    pytest.importorskip("torch")
    world = 2
    results = run_ranks(world, device_workers.gpu_adapters, gpu_daemon.socket, world, timeout=300)
    for r in results:
        assert r["torch"] == [3.0, 3.0, 3.0] and r["torch_bf16"] == [3.0, 3.0, 3.0]
        assert r["cupy"] == [3.0, 3]
        assert r["registrations"] >= 3
        if "jax" in r:
            assert r["jax"] == [3.0, 3.0, 3.0]
    row = _rows(gpu_daemon.socket)[0]
    assert row.open_allocations == 0 and row.ipc_opens == row.ipc_closes > 0


def test_a_killed_client_releases_its_ipc_mappings(gpu_daemon, tmp_path):
    ctx = mp.get_context("spawn")
    ready = tmp_path / "ready"
    proc = ctx.Process(target=device_workers.cupy_register_and_sleep, args=(0, gpu_daemon.socket, str(ready)))
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and proc.is_alive()
        time.sleep(0.05)
    assert _rows(gpu_daemon.socket)[0].open_allocations == 1
    proc.kill()
    proc.join(10)
    deadline = time.monotonic() + 5
    while _rows(gpu_daemon.socket)[0].open_allocations:
        assert time.monotonic() < deadline, "the killed client's allocation stayed open"
        time.sleep(0.05)


def test_cuda_buffers_across_two_daemons_on_loopback(tmp_path):
    """Two daemons on loopback peers (the TCP peer transport: no ucxx needed) serving the
    same GPU, two cupy ranks on each: every collective in and out of place crosses the
    peer plane through the chunk-wise staging, checked against numpy."""
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "cuda:0", "--peer-transport", "tcp")
    try:
        world, count = 4, 100_003
        kinds = [("float32", "sum"), ("float64", "max"), ("int32", "sum"), ("float16", "min")]
        cases = rotating_cases(world, count, kinds, root=3, seed=25)
        results = run_ranks(
            world,
            device_workers.run_cases_on_nodes,
            daemons.sockets,
            2,
            world,
            [0, 0, 0, 0],
            cases,
            "cupy",
            timeout=300,
        )
        check_case_results(cases, results, world)
    finally:
        daemons.stop_and_check()


def test_a_gpu_named_under_another_ordinal_is_mapped_by_its_uuid(gpu_daemon):
    """On one GPU the daemon cannot be given another CUDA_VISIBLE_DEVICES order, so the
    client's ordinal is made to lie (7): the UUID in the handle decides; an unknown UUID
    is refused by name (issue 25, point 2)."""
    (seen,) = run_ranks(1, device_workers.under_another_ordinal, gpu_daemon.socket, "cupy")
    assert seen["allreduce"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "does not serve" in seen["refused"] and "device 7" in seen["refused"], seen


HIERARCHICAL_KINDS = [("float32", "sum"), ("float64", "avg"), ("int32", "max"), ("float16", "min")]


def _hierarchical_ops_on_two_daemons(tmp_path, algorithm: str, seed: int, *flags: str) -> None:
    """Two daemons on one GPU machine (``flags`` added), two cupy ranks each, 256 KiB of
    staging: the five hierarchical ops that ``algorithm`` offers, against numpy."""
    from lpsync.algorithms.registry import algorithms_for
    from lpsync.types import Collective

    daemons = PeeredDaemons(tmp_path, 2, "--devices", "cuda:0", "--device-staging-bytes", "262144", *flags)
    try:
        world, count = 4, 200_003
        ops = {"allreduce", "reduce", "broadcast", "allgather", "reduce_scatter"}
        cases = [
            c
            for c in rotating_cases(world, count, HIERARCHICAL_KINDS, root=2, seed=seed)
            if c[0] in ops and algorithm in algorithms_for(Collective(c[0]))
        ]
        args = (daemons.sockets, 2, world, [0] * world, cases, "cupy", algorithm)
        results = run_ranks(world, device_workers.run_cases_on_nodes, *args, timeout=300)
        check_case_results(cases, results, world)
    finally:
        daemons.stop_and_check()


@pytest.mark.parametrize("algorithm", ["lp", "ring", "be"])
def test_hierarchical_ops_across_two_daemons_through_a_small_ring(tmp_path, algorithm):
    """Allreduce, reduce, broadcast, allgather and reduce_scatter run hierarchically: peer
    copies and reductions on the GPU inside each daemon, 256 KiB of pinned staging at the
    boundary, so each message crosses in several segments."""
    _hierarchical_ops_on_two_daemons(tmp_path, algorithm, 41, "--peer-transport", "tcp")


@pytest.mark.parametrize("algorithm", ["lp", "ring"])
def test_hierarchical_ops_cross_from_device_memory_through_cuda_aware_ucx(tmp_path, algorithm):
    """The direct device path on a GPU: two daemons on UCX with its cuda transports
    (--peer-device-path device), so each segment crosses from the boundary's device memory
    (ucxx posting cupy arrays, UCX's cuda_copy) and chunks are reduced by the daemon's
    kernels. Skipped, saying why, where this UCX reports no cuda transport."""
    from lpsync.transport import backends

    tls = "tcp,cuda_copy,cuda_ipc"
    path = backends.device_path("ucx", "cuda", tls)
    if path.path != "device":
        pytest.skip(f"no CUDA-aware UCX here: {path.reason}")
    flags = ("--peer-transport", "ucx", "--ucx-tls", tls, "--peer-device-path", "device")
    _hierarchical_ops_on_two_daemons(tmp_path, algorithm, 43, *flags)


def test_hierarchical_allreduce_of_256_mib_holds_host_memory_to_the_staging_bound(tmp_path):
    """A 256 MiB allreduce of cupy arrays across two daemons on one GPU machine: each
    daemon's resident host memory (GPU memory is not in it) grows by at most its 16 MiB
    staging bound plus slack; whole-buffer staging took 512 MiB per daemon."""
    import tests.daemon.hierarchy_workers as hierarchy_workers

    bound = 16 << 20
    daemons = PeeredDaemons(
        tmp_path, 2, "--devices", "cuda:0", "--peer-transport", "tcp", "--device-staging-bytes", str(bound)
    )
    try:
        node_of = [0, 0, 1, 1]
        warm = run_ranks(4, hierarchy_workers.big_allreduce, daemons.sockets, node_of, 1 << 16, "cupy")
        assert all(r["ok"] for r in warm)  # CUDA contexts, streams, pools: before the baseline
        pids = [d.pid for d in daemons.daemons if d is not None]
        with MemoryPeak(pids, "VmRSS") as memory:
            results = run_ranks(
                4, hierarchy_workers.big_allreduce, daemons.sockets, node_of, 64 << 20, "cupy", timeout=300
            )
        assert all(r["ok"] for r in results)
        for grown in memory.growth_kib:
            assert grown <= (bound >> 10) + (64 << 10), f"host memory grew by {grown >> 10} MiB"
    finally:
        daemons.stop_and_check()


def test_uneven_nodes_on_one_gpu_machine(tmp_path):
    """Three daemons serving 2, 1 and 2 cupy ranks (the one-rank node holds the root): the
    hierarchical ops with the tuner's choice, a store-discovered layout."""
    from tests.daemon import hierarchy_workers
    from tests.ports import free_ports

    daemons = PeeredDaemons(tmp_path, 3, "--devices", "cuda:0", "--peer-transport", "tcp")
    try:
        node_of = [0, 0, 1, 2, 2]
        ops = {"allreduce", "reduce", "broadcast", "allgather", "reduce_scatter"}
        cases = [c for c in rotating_cases(5, 100_003, HIERARCHICAL_KINDS, root=2, seed=43) if c[0] in ops]
        results = run_ranks(
            5,
            hierarchy_workers.cases_on_nodes,
            daemons.sockets,
            node_of,
            [0] * 5,
            cases,
            "",
            free_ports(1)[0],
            "cupy",
            timeout=300,
        )
        check_case_results(cases, results, 5)
    finally:
        daemons.stop_and_check()
