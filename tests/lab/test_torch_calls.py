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
    # One round: the backend's share is the two rows' difference (each rounded to 1 us).
    lines = done.stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if not line.startswith("#")}
    share = next(line for line in done.stdout.splitlines() if line.startswith("# lpsync - client"))
    printed = float(share.split("time ")[1].split(" us")[0])
    assert abs(printed - (float(rows["lpsync"][0]) - float(rows["client"][0]))) <= 1.5, done.stdout


def test_bad_arguments_are_refused() -> None:
    done = run_bench("torch_calls", "--procs", "1")
    assert done.returncode == 2 and "--procs must be >= 2" in done.stderr


def _both_measured(done: subprocess.CompletedProcess[str]) -> None:
    """The run succeeded with a time and a CPU figure for each engine (the backend, gloo,
    and the group's own client without the backend above it) and their ratios."""
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in done.stdout.splitlines()
        if not line.startswith("#")
    }
    assert set(rows) == {"lpsync", "gloo", "client"}, done.stdout
    for seconds, cpu in rows.values():
        assert seconds > 0 and cpu > 0, done.stdout
    assert "# lpsync / gloo (median of rounds): time " in done.stdout
    # The backend's share is the difference of the two rows' medians, as printed.
    share = next(line for line in done.stdout.splitlines() if line.startswith("# lpsync - client"))
    assert share.split("time ")[1].split(" us")[0].lstrip("-").isdigit(), share
