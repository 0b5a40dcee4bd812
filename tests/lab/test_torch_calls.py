"""``python -m lab.torch_calls``: small synchronous torch.distributed calls on
the lpsync backend beside gloo, real ranks and a real daemon, in one run."""

from __future__ import annotations

import subprocess

import pytest

from tests.lab.modules import run_bench

pytest.importorskip("torch")


def test_lpsync_and_gloo_side_by_side() -> None:
    # reduce_scatter_tensor: the op whose buffers differ in size (each rank's block out).
    done = run_bench(
        "torch_calls",
        "--procs",
        "2",
        "--iters",
        "30",
        "--rounds",
        "2",
        "--warmup",
        "5",
        "--op",
        "reduce_scatter",
    )
    _both_measured(done)
    assert "synchronous dist.reduce_scatter of 4 B a rank" in done.stdout


def test_a_barrier_has_no_size() -> None:
    done = run_bench(
        "torch_calls", "--procs", "2", "--iters", "20", "--rounds", "1", "--warmup", "2", "--op", "barrier"
    )
    _both_measured(done)
    assert "synchronous dist.barrier, 1 rounds of 20 calls" in done.stdout, done.stdout


def test_bad_arguments_are_refused() -> None:
    done = run_bench("torch_calls", "--procs", "1")
    assert done.returncode == 2 and "--procs must be >= 2" in done.stderr


def _both_measured(done: subprocess.CompletedProcess[str]) -> None:
    """The run succeeded with a time and a CPU figure for each engine and their ratio."""
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in done.stdout.splitlines()
        if not line.startswith("#")
    }
    assert set(rows) == {"lpsync", "gloo"}, done.stdout
    for seconds, cpu in rows.values():
        assert seconds > 0 and cpu > 0, done.stdout
    assert "# lpsync / gloo (median of rounds): time " in done.stdout
