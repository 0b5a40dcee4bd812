"""``python -m lab.loopback_cpu``: real daemons on loopback and rank processes;
every rank checks its sum, and the CPU and switch columns are read from real processes."""

from __future__ import annotations

from tests.lab.modules import run_bench


def test_two_daemons_report_time_and_cpu_per_call() -> None:
    done = run_bench("loopback_cpu", "--nodes", "2", "--iters", "50", "--bytes", "64")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [0, 1], done.stdout
    for _, seconds, daemon, rank, daemon_switches, rank_switches in rows:
        assert float(seconds) > 0 and float(daemon) > 0 and float(rank) > 0, done.stdout
        # Each call wakes the daemon for the request and the rank for the reply, at least.
        assert float(daemon_switches) >= 1 and float(rank_switches) >= 1, done.stdout
    assert "# mean per daemon" in done.stdout and "context switches per daemon and call" in done.stdout


def test_bad_arguments_are_refused() -> None:
    done = run_bench("loopback_cpu", "--nodes", "0", timeout=60)
    assert done.returncode == 2 and "--nodes and --iters must be >= 1" in done.stderr
