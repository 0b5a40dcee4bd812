"""The rank-process harness itself: a rank that hangs is reported by rank, and leaves every
thread's stack in the test's stderr before it is killed."""

from __future__ import annotations

import time

import pytest

from tests.daemon.harness import run_ranks


def sleeps_as_rank_1(rank: int) -> int:
    if rank == 1:
        time.sleep(600)  # the hang
    return rank


def test_a_rank_that_hangs_is_named_and_leaves_its_stacks(capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not report within 5"):
        run_ranks(2, sleeps_as_rank_1, timeout=5.0)
    assert time.monotonic() - started < 20
    err = capfd.readouterr().err
    assert "sleeps_as_rank_1" in err and "thread 0x" in err, err[-2000:]
