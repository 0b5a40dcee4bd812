"""DDP with the lpsync hook, DistributedOptimizer and the broadcasts, in real trainer
processes through real daemons, against gloo, per-tensor allreduce and one process."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.daemon.harness import DaemonProcess, PeeredDaemons, run_ranks
from tests.ports import free_ports
from tests.training.trainers import (
    broadcasts,
    ddp_gloo_and_lpsync,
    distributed_optimizer,
    hook_does_not_block,
    killed_midway,
    single_process,
)

STEPS = 6
TOL = 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_hook_equals_gloo_and_one_process(daemon: DaemonProcess, world: int) -> None:
    (port,) = free_ports(1)
    results = run_ranks(
        world, ddp_gloo_and_lpsync, world, [daemon.socket], world, f"ddp{world}", port, STEPS, timeout=120
    )
    reference = single_process(world, STEPS)
    for rank, (gloo, lpsync, replaced) in enumerate(results):
        assert np.abs(lpsync - gloo).max() <= TOL, f"rank {rank}: lpsync vs gloo"
        assert np.abs(lpsync - reference).max() <= TOL, f"rank {rank}: lpsync vs one process"
        assert np.array_equal(lpsync, results[0][1]), "ranks disagree"
        assert replaced >= 1, "DDP rebuilds its buckets after the first step"
    # Training moved the parameters: the comparison is not between two untouched models.
    assert np.abs(reference - single_process(world, 0)).max() > 1e-3


def test_ddp_hook_across_two_daemons(tmp_path: Path) -> None:
    pytest.importorskip("ucxx")
    daemons = PeeredDaemons(tmp_path, 2)
    try:
        (port,) = free_ports(1)
        results = run_ranks(
            4, ddp_gloo_and_lpsync, 4, daemons.sockets, 2, "ddp-2nodes", port, STEPS, timeout=150
        )
    finally:
        daemons.stop_and_check()
    reference = single_process(4, STEPS)
    for rank, (gloo, lpsync, _) in enumerate(results):
        assert np.abs(lpsync - gloo).max() <= TOL, f"rank {rank}: lpsync vs gloo"
        assert np.abs(lpsync - reference).max() <= TOL, f"rank {rank}: lpsync vs one process"


def test_hook_returns_before_the_collective_completes(daemon: DaemonProcess) -> None:
    (port,) = free_ports(1)
    (inside, backward), _ = run_ranks(2, hook_does_not_block, 2, daemon.socket, "overlap", port, timeout=120)
    assert backward > 1.5, "rank 0's backward should have waited for the late rank"
    assert inside < 0.5, f"the hook blocked for {inside:.2f} s of the {backward:.2f} s"


def test_distributed_optimizer_equals_per_tensor_allreduce(daemon: DaemonProcess) -> None:
    results = run_ranks(3, distributed_optimizer, 3, daemon.socket, "dopt", STEPS, timeout=120)
    reference = single_process(3, STEPS)
    for rank, (fused, per_tensor, buckets) in enumerate(results):
        assert buckets > 2, "the bucket size should have split the gradients"
        assert np.abs(fused - per_tensor).max() <= 1e-6, f"rank {rank}"
        assert np.abs(fused - reference).max() <= TOL, f"rank {rank}: vs one process"


def test_broadcast_parameters_and_optimizer_state(daemon: DaemonProcess) -> None:
    results = run_ranks(3, broadcasts, 3, daemon.socket, "bcast", timeout=90)
    root_params, root_state = results[1]
    assert root_state["steps"] == [3.0] * 6 and root_state["lr"] == pytest.approx(0.02)
    for rank, (params, state) in enumerate(results):
        np.testing.assert_array_equal(params, root_params, err_msg=f"rank {rank}")
        assert state["lr"] == root_state["lr"] and state["steps"] == root_state["steps"]
        np.testing.assert_array_equal(state["exp_avg"], root_state["exp_avg"])
        if rank != 1:  # it started elsewhere: parameters and BatchNorm's running statistics
            assert not np.allclose(state["before"], root_params)


def test_killed_trainer_fails_the_others(daemon: DaemonProcess) -> None:
    (port,) = free_ports(1)
    victim = 2
    results = run_ranks(
        3, killed_midway, 3, daemon.socket, "killed", port, victim, dies=(victim,), timeout=90
    )
    reports = {rank: text for rank, text in enumerate(results) if rank != victim}
    assert set(reports) == {0, 1}
    for rank, text in reports.items():
        seconds = float(text.split("s ", 1)[0])
        # Named either way the daemon words it: "rank 2 ..." or "lost rank(s) 2 (...)"; the other
        # survivor may have given up first and be listed before it: "lost rank(s) 1 (detached), 2 (...)".
        lost = r"\brank(\(s\))? (\d+ \([^)]*\), )*2\b"
        assert "AbortedError" in text and re.search(lost, text), f"rank {rank}: {text}"
        assert seconds < 40, f"rank {rank} took {seconds} s to fail: {text}"
