"""``python -m lab.leaf_floor``: the bare imitation (real processes and sockets)
beside real daemons on loopback, in one run."""

from __future__ import annotations

from tests.lab.modules import run_bench


def test_the_floor_and_the_daemons_side_by_side() -> None:
    done = run_bench("leaf_floor", "--nodes", "2", "--iters", "50")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in done.stdout.splitlines()
        if not line.startswith("#")
    }
    assert set(rows) == {"floor", "lpsync"}, done.stdout
    for seconds, leaf, root, rank, switches in rows.values():
        assert seconds > 0 and leaf > 0 and root > 0 and rank > 0, done.stdout
        # A leaf wakes at least for the request and for the verdict.
        assert switches >= 1.5, done.stdout
    # The daemons make the same system calls and run their logic besides.
    assert rows["lpsync"][1] > rows["floor"][1], done.stdout
    # The client builds its request and parses its reply besides the same two calls.
    assert rows["lpsync"][3] > rows["floor"][3], done.stdout
    assert "# lpsync / floor: leaf" in done.stdout


def test_bad_arguments_are_refused() -> None:
    done = run_bench("leaf_floor", "--nodes", "1")
    assert done.returncode == 2 and "--nodes must be >= 2" in done.stderr
