"""The 60-second seeded chaos run (root: an emulated cluster of 4 nodes x 2 ranks): daemons
and trainers SIGKILLed and SIGSTOPped, links cut one way and both, while every collective
is checked; no wrong result, every failure within its bound, rejoins, nothing left
(lpsync.bench.chaos; the 10-minute run is in docs/reliability.md)."""

from __future__ import annotations

import os

from lpsync.bench.chaos import options, run
from lpsync.bench.chaos_report import table
from tests.cluster.test_cluster import needs_netns


@needs_netns
def test_a_seeded_minute_of_chaos_passes_every_check() -> None:
    args = options(["--seconds", "60", "--seed", "21", "--prefix", f"tc{os.getpid() % 100000}"])
    summary = run(args)
    report = table(summary, "chaos, 60 s, seed 21")
    print(report)
    assert sum(summary["faults"].values()) >= 5, report  # the schedule really ran
    assert summary["collectives_ok"] > 0 and summary["wrong"] == 0, report
    assert summary["rejoins"] == sum(summary["faults"].values()), report
    assert summary["leaks"] == 0, report
    assert summary["passed"], report
