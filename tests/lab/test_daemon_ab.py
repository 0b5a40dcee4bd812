"""``python -m lab.daemon_ab``: a revision checked out beside this tree, real
daemons run from each tree in turn, the ratios printed, the worktree removed."""

from __future__ import annotations

import subprocess

from lab.daemon_ab import HERE, Run, _ratios
from tests.lab.modules import run_bench


def _worktrees() -> str:
    return subprocess.run(
        ["git", "-C", str(HERE), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout


def test_one_pair_against_this_revision_prints_ratios_and_leaves_no_worktree() -> None:
    before = _worktrees()
    done = run_bench("daemon_ab", "--base", "HEAD", "--pairs", "1", "--nodes", "2", "--iters", "50")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) == 1 and rows[0][0] == "1", done.stdout
    ratios = [float(v) for v in rows[0][rows[0].index("|") + 1 :]]
    assert len(ratios) == 5 and all(r > 0 for r in ratios), done.stdout
    assert "# median this / base over 1 pair(s)" in done.stdout
    assert "lpsync-ab-" not in _worktrees() and _worktrees() == before


def test_an_unknown_revision_is_refused() -> None:
    done = run_bench("daemon_ab", "--base", "no-such-revision-here", "--pairs", "1", timeout=60)
    assert done.returncode != 0 and "git worktree add no-such-revision-here failed" in done.stderr


def test_the_ratios_divide_this_by_base_and_per_rank() -> None:
    base = Run(node0=600, leaf=300, mean=330, rank=100, time=2000)
    this = Run(node0=540, leaf=240, mean=280, rank=80, time=1900)
    node0, leaf, mean, mean_per_rank, leaf_per_rank = _ratios(base, this)
    assert (node0, leaf) == (0.9, 0.8) and abs(mean - 280 / 330) < 1e-12
    assert abs(mean_per_rank - (280 / 80) / (330 / 100)) < 1e-12 and leaf_per_rank == 1.0


def test_a_run_is_read_from_loopback_cpus_table() -> None:
    output = """# 3 daemon(s) on loopback, one rank each, 10 allreduces of 4 B
# node  time/call (us)  daemon CPU/call (us)  rank CPU/call (us)  daemon switches/call  rank switches/call
     0             900                   500                  70                   6.0                 1.1
     1             900                   300                  80                   3.2                 1.4
     2             900                   200                  90                   3.2                 1.3
# mean per daemon 333 us, per rank 80 us; 4.1 context switches per daemon and call
"""
    run = Run.parse(output)
    assert (run.node0, run.leaf, run.rank, run.time) == (500, 250, 80, 900)
    assert abs(run.mean - 1000 / 3) < 1e-9


def test_a_run_is_read_from_the_older_four_column_table() -> None:
    # loopback_cpu before 2026-12-06 printed no context switches: --head/--base of that time
    output = """# 3 daemon(s) on loopback, one rank each, 10 allreduces of 4 B
# node  time/call (us)  daemon CPU/call (us)  rank CPU/call (us)
     0             900                   500                  70
     1             900                   300                  80
     2             900                   200                  90
# mean per daemon 333 us, per rank 80 us
"""
    run = Run.parse(output)
    assert (run.node0, run.leaf, run.rank, run.time) == (500, 250, 80, 900)


def test_head_checks_out_a_second_revision_and_removes_both() -> None:
    before = _worktrees()
    done = run_bench(
        "daemon_ab", "--base", "HEAD~1", "--head", "HEAD", "--pairs", "1", "--nodes", "1", "--iters", "50"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "against HEAD (" in done.stdout and "this tree" not in done.stdout, done.stdout
    assert _worktrees() == before
