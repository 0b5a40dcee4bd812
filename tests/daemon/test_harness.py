"""The rank-process harness itself: a rank that hangs is reported by rank, with every
thread's stack taken before it is killed."""

from __future__ import annotations

import time

import pytest

from tests.daemon.harness import run_ranks


def sleeps_as_rank_1(rank: int) -> int:
    if rank == 1:
        time.sleep(600)  # the hang
    return rank


def test_a_rank_that_hangs_is_named_with_its_stacks() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not report within 5") as failed:
        run_ranks(2, sleeps_as_rank_1, timeout=5.0)
    assert time.monotonic() - started < 20
    message = str(failed.value)
    assert "rank 1, hanging, was at:" in message and "sleeps_as_rank_1" in message, message
    assert "rank 0, hanging" not in message  # it returned
