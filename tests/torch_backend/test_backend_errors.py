"""Failures on the ``lpsync`` backend surface as torch.distributed errors carrying lpsync's
message, at once or within their bound, never as a hang: a killed rank, a mismatch, a rank
that never arrives, an operation lpsync does not offer, no daemon to attach to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from harness import ROOT, run_ranks
from ports import free_ports
from torch_workers import errors, killed_rank


def test_a_killed_rank_fails_the_others_with_an_error(daemon) -> None:
    results = run_ranks(3, killed_rank, 3, [daemon.socket], 3, free_ports(1)[0],
                        timeout=120, dies=(2,))
    for kind, message, seconds in results[:2]:
        assert kind == "DistBackendError", (kind, message)
        assert "rank 2" in message and "left" in message, message
        assert seconds < 10.0, (seconds, message)  # the daemon's bound: 2 s


def test_a_killed_rank_fails_the_others_across_two_daemons(two_nodes) -> None:
    results = run_ranks(4, killed_rank, 4, two_nodes.sockets, 2, free_ports(1)[0],
                        timeout=120, dies=(3,))
    for kind, message, seconds in results[:3]:
        assert kind == "DistBackendError", (kind, message)
        assert "rank 3" in message, message
        assert seconds < 15.0, (seconds, message)


def test_refused_operations_mismatch_and_timeout(daemon) -> None:
    results = run_ranks(2, errors, 2, [daemon.socket], 2, free_ports(1)[0], timeout=120)
    for rank, seen in enumerate(results):
        for op in ("send", "recv", "all_to_all", "all_to_all_single", "scatter", "gather"):
            assert seen[op].startswith("UnsupportedOperationError: the lpsync backend does "
                                       f"not support {op}"), (op, seen[op])
        assert "BAND" in seen["band"] and seen["band"].startswith("ValueError"), seen["band"]
        assert "PREMUL_SUM" in seen["premul_sum"], seen["premul_sum"]
        assert "int16" in seen["int16 dtype"], seen["int16 dtype"]
        assert "bool" in seen["bool avg"], seen["bool avg"]
        # complex tensors: torch passes their real view for broadcast, which is supported
        assert seen["complex64 dtype"] in ("no error",) or "complex" in seen["complex64 dtype"]
        assert seen["mismatch"].startswith("DistBackendError: lpsync all_reduce failed"), seen
        assert "count" in seen["mismatch"], seen["mismatch"]
        assert float(seen["mismatch seconds"]) < 5.0, seen
        if rank == 1:
            assert seen["timeout"].startswith("DistBackendError"), seen["timeout"]
            assert "rank(s) 0 did not arrive" in seen["timeout"], seen["timeout"]
            assert 7.0 <= float(seen["timeout seconds"]) < 14.0, seen


def test_no_daemon_is_an_error_at_init(tmp_path) -> None:
    script = textwrap.dedent("""
        import torch.distributed as dist, lpsync_client.torch
        try:
            dist.init_process_group("lpsync", store=dist.HashStore(), rank=0, world_size=1)
        except dist.DistBackendError as error:
            print("error:", error)
    """)
    env = {**os.environ, "LPSYNC_SOCKET": str(tmp_path / "nobody.sock"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90, env=env)
    assert "error: lpsync: rank 0" in done.stdout, done.stdout + done.stderr
    assert "nobody.sock" in done.stdout and "no lpsync daemon answers" in done.stdout
