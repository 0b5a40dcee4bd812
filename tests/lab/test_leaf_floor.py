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
    # No order between the two is asserted: the native path brings a leaf's CPU down
    # to the floor's, and which is lower on a given run is noise. The ratios printed
    # must be the rows' own (rounded to whole microseconds in the table).
    ratios = next(line for line in done.stdout.splitlines() if line.startswith("# lpsync / floor:"))
    printed = dict(part.split()[:2] for part in ratios.split(":", 1)[1].split("(")[0].split(","))
    for column, index in (("leaf", 1), ("rank", 3), ("time", 0)):
        lpsync, floor = rows["lpsync"][index], rows["floor"][index]
        # Each table cell is off by up to half a unit; the ratio by 0.005 more.
        slack = (0.5 / lpsync + 0.5 / floor) * lpsync / floor + 0.006
        assert abs(float(printed[column]) - lpsync / floor) <= slack, done.stdout


def test_bad_arguments_are_refused() -> None:
    done = run_bench("leaf_floor", "--nodes", "1")
    assert done.returncode == 2 and "--nodes must be >= 2" in done.stderr
