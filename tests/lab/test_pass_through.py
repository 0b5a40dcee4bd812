"""``python -m lab.pass_through``: real processes on a TCP mesh over loopback,
data flow on and off; every rank's buffer is checked against numpy's result."""

from __future__ import annotations

import re

import pytest

from tests.lab.modules import run_bench


@pytest.mark.parametrize("op", ["broadcast", "allreduce"])
def test_four_ranks_report_cpu_per_call_as_data_flow_and_not(op: str) -> None:
    done = run_bench(
        "pass_through", "--op", op, "--ranks", "4", "--bytes", "1MiB", "--chunks", "3,16", "--reps", "2"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1]) for r in rows] == [
        (chunks, mode) for chunks in ("3", "16") for mode in ("on", "off", "on/off")
    ], done.stdout
    for row in rows:
        root, middle, last = (float(v) for v in row[3:])
        assert root > 0 and middle > 0 and last > 0, done.stdout
    assert "# wrong elements: 0" in done.stdout
    assert re.search(r"4 ranks, median CPU ms per call of 2; middle = mean of ranks 1\.\.2", done.stdout)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ranks", "2"], "--ranks must be 3 or more"),
        (["--chunks", "4,x"], "--chunks takes whole numbers"),
        (["--chunks", "0"], "every chunk count 1 or more"),
        (["--op", "gather"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused(flags: list[str], message: str) -> None:
    done = run_bench("pass_through", *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
