"""A job whose nodes mix host and device buffers takes the flat path (collectives/staging.py),
over real daemons and client processes: node 0's ranks pass emulated device buffers, node
1's host buffers. Every op against numpy, and the device node's host memory bounded by its
slots where host mirrors grew it by its ranks' buffers whole (second reading, "the mixed
host/device flat path mirrors whole buffers")."""

from __future__ import annotations

from pathlib import Path

import tests.daemon.hierarchy_workers as workers
from tests.collective_cases import check_case_results, rotating_cases
from tests.daemon.harness import MemoryPeak, PeeredDaemons, run_ranks

KINDS = [("float32", "sum"), ("float64", "avg"), ("int32", "max"), ("bfloat16", "sum"), ("float16", "min")]


def test_cuda_contract_every_op_of_a_job_mixing_host_and_device_buffers(tmp_path: Path) -> None:
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", "65536")
    try:
        node_of, devices = [0, 0, 1, 1], [0, 1, 0, 1]
        cases = rotating_cases(4, 40_000, KINDS, root=1, seed=45)  # over 64 KiB: none rides the agreement
        results = run_ranks(
            4, workers.cases_mixed, daemons.sockets, node_of, devices, cases, [1], timeout=300
        )
        check_case_results(cases, results, 4)
    finally:
        daemons.stop_and_check()


def test_cuda_contract_the_device_node_of_a_mixed_job_holds_no_mirrors(tmp_path: Path) -> None:
    """64 MiB float32 per rank, the device node's two ranks in place: host mirrors grew that
    daemon's host memory by 128 MiB; its slots stay within --device-staging-bytes (8 MiB)
    and what the transports lend while a message is received."""
    bound = 8 << 20
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2", "--device-staging-bytes", str(bound))
    try:
        node_of, frameworks = [0, 0, 1, 1], ["emulated", "host"]
        warm = run_ranks(4, workers.big_allreduce, daemons.sockets, node_of, 1 << 16, frameworks)
        assert all(r["ok"] for r in warm)
        node0 = daemons.daemons[0]
        assert node0 is not None
        with MemoryPeak([node0.pid], "RssAnon") as memory:
            results = run_ranks(
                4, workers.big_allreduce, daemons.sockets, node_of, 16 << 20, frameworks, timeout=600
            )
        assert all(r["ok"] for r in results)
        grown = memory.growth_kib[0]
        assert grown <= 3 * (bound >> 10), f"the device node's host memory grew by {grown >> 10} MiB"
    finally:
        daemons.stop_and_check()
