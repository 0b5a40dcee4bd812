"""PyTorch's own distributed tests on lpsync and gloo, inside `make test`: the runner's
``--quick`` selection (tests/torch_suite/runner.py, QUICK) on both backends must show no
test that passes on gloo and fails on lpsync without being in known_gaps.toml. The whole
selection is `make torch-suite` (docs/training.md, "PyTorch's own test suite")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip(
    "expecttest", reason="torch's test suite imports expecttest: pip install expecttest (the test extra)"
)

from tests.torch_suite import runner


def _result(backend: str, test: str, outcome: str, ws: int = 2) -> runner.Result:
    return runner.Result(backend, ws, test, outcome)


def test_the_comparison_tells_regressions_from_listed_gaps_and_fixed_ones():
    known = {
        "test_listed": runner.Gap("unsupported: send/recv"),
        "test_fixed": runner.Gap("was broken"),
        "test_only_at_3": runner.Gap("a world-size-3 gap", (3,)),
        "test_not_run": runner.Gap("not in this selection"),
    }
    results = []
    for test, gloo, lp in [
        ("test_listed", "passed", "failed"),
        ("test_fixed", "passed", "passed"),
        ("test_new", "passed", "failed"),
        ("test_only_at_3", "passed", "failed"),  # at world size 2: not listed there
        ("test_gloo_fails", "failed", "failed"),
        ("test_skipped", "passed", "skipped"),  # skipped on lpsync only: a gap too
    ]:
        results += [_result("gloo", test, gloo), _result("lpsync", test, lp)]
    cmp = runner.compare(results, known)
    assert [lp.test for _, lp in cmp.gaps] == [
        "test_listed",
        "test_new",
        "test_only_at_3",
        "test_skipped",
    ]
    assert [lp.test for lp, _ in cmp.expected] == ["test_listed"]
    assert sorted(lp.test for lp in cmp.regressions) == ["test_new", "test_only_at_3", "test_skipped"]
    assert [lp.test for lp, _ in cmp.now_pass] == ["test_fixed"]
    assert cmp.unjudged == ["test_not_run", "test_only_at_3"]


def test_every_listed_gap_has_a_reason(tmp_path: Path):
    known = runner.load_known(runner.KNOWN)
    for test, gap in known.items():
        assert test.startswith("test_"), test
        assert len(gap.reason.strip()) >= 10, f"{test}: give the reason in a line"
        assert all(ws >= 2 for ws in gap.world_sizes), test
    bad = tmp_path / "bad.toml"
    bad.write_text('[gaps]\ntest_x = ""\n')
    with pytest.raises(ValueError, match="no reason"):
        runner.load_known(bad)


def test_the_quick_selection_has_no_regression_against_the_list(tmp_path: Path):
    """Both backends, world size 2, one local daemon; a regression fails with the runner's
    report (the lpsync failure's reason, and results.json and the logs in the output)."""
    t0 = time.monotonic()
    # One worker per backend: a worker's start (torch's suite imported by it and again by its
    # forkserver, ~11 CPU-s on 2 cores) costs more than the whole selection's tests (~0.5 s
    # each); the default --shard 16 started two per backend.
    shard = ["--shard", str(len(runner.QUICK))]
    command = [
        "-m",
        "tests.torch_suite.runner",
        "--quick",
        "--world-sizes",
        "2",
        *shard,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=runner.ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    took = time.monotonic() - t0
    print(proc.stdout[-12000:], proc.stderr[-4000:], f"\n{took:.0f} s", sep="\n")
    assert proc.returncode == 0, f"torch-suite --quick failed ({proc.returncode}):\n{proc.stdout[-6000:]}"

    results = json.loads((tmp_path / "results.json").read_text())
    outcome = {(r["backend"], r["test"]): r["outcome"] for r in results}
    assert len(outcome) == 2 * len(runner.QUICK)
    # The suite really ran on lpsync: its collectives and DDP pass there as on gloo.
    for test in ("test_all_reduce_sum", "test_broadcast_full_group", "test_DistributedDataParallelCPU"):
        assert outcome[("gloo", test)] == outcome[("lpsync", test)] == "passed", test
    # A test torch skips for anything but gloo ran on lpsync (lifted), and counted.
    assert any(r["lifted"] and r["outcome"] != "skipped" for r in results)
    # Every listed test is a test of torch's suite as this torch ships it.
    listing = json.loads(next((tmp_path / "workers").glob("*-list-gloo-2.jsonl")).read_text())
    assert set(runner.load_known(runner.KNOWN)) <= set(listing["tests"])
