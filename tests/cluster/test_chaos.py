"""The 60-second seeded chaos run (root: an emulated cluster of 4 nodes x 2 ranks): daemons
and trainers SIGKILLed and SIGSTOPped, links cut one way and both, while every collective
is checked (`lpsync chaos`, lpsync/chaos; docs/reliability.md, "Chaos").

Every check of the run is asserted: no wrong result delivered as OK, every error within
its kind's bound, no hang, survivors keep serving, every rank succeeds again within 45 s
of each release, clean exits, nothing left behind.
"""

from __future__ import annotations

import os

from lpsync.chaos.report import table
from lpsync.chaos.run import run
from lpsync.cli import build_parser
from tests.cluster.test_cluster import needs_netns

CHECKS = (
    "no wrong result delivered as OK",
    "every failure within its bound",
    "no hang beyond the bound",
    "survivors keep serving",
    "restarted daemons rejoin",
    "clean exits at the end (<= 5 s)",
    "nothing left behind",
)


@needs_netns
def test_a_seeded_minute_of_chaos_keeps_results_right_and_leaves_nothing() -> None:
    # The operator's command line, through the CLI's own parser (`lpsync chaos`)
    args = build_parser().parse_args(
        ["chaos", "--seconds", "60", "--seed", "21", "--prefix", f"tc{os.getpid() % 100000}"]
    )
    summary = run(args)
    report = table(summary, "chaos, 60 s, seed 21")
    print(report)
    assert set(summary["checks"]) == set(CHECKS), report  # a renamed check is not skipped
    assert sum(summary["faults"].values()) >= 3, report  # the schedule really ran (fewer under load)
    assert summary["collectives_ok"] > 0 and summary["wrong"] == 0, report
    assert summary["rejoins"] == sum(summary["faults"].values()), report  # after every release
    for name in CHECKS:
        assert not summary["checks"][name], f"{name}\n{report}"
    assert summary["passed"], report
    assert summary["leaks"] == 0, report
