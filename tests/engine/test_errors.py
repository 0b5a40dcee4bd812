"""Failure paths: missing participants time out, aborts stop waits, bad requests are
rejected at once, and nothing is left running afterwards."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lpsync.algorithms import ALGORITHMS, Schedule, generate
from lpsync.algorithms.schedule import Buf, ScheduleBuilder
from lpsync.engine.executor import Plan, deadline_after
from lpsync.engine.group import LocalGroup, layout
from lpsync.errors import (
    AbortedError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    UnavailableError,
)
from lpsync.reduction import Reduction
from lpsync.transport.inproc import InprocFabric
from lpsync.types import ReduceOp
from tests.collective_cases import C


def plans_for(op: C, algorithm: str, p: int, count: int, ranks: list[int], root: int = 0) -> list[Plan]:
    s = generate(op, algorithm, p, count, root, 4)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), p)
    return [
        Plan(s, r, layout(op, r, p, count, np.ones(s.in_elements(r), np.float32), False, root), reduction)
        for r in ranks
    ]


def run_in_threads(
    plans: list[Plan], fabric: InprocFabric, timeout: float
) -> tuple[dict[int, BaseException | None], dict[int, float]]:
    """Run each plan in a thread of its own; each rank's exception (or None) and when it
    ended, in seconds from the start."""
    errors: dict[int, BaseException | None] = {}
    ended: dict[int, float] = {}
    start = time.monotonic()
    deadline = deadline_after(timeout)

    def body(plan: Plan) -> None:
        try:
            plan.run(fabric.endpoint(plan.rank), deadline)
            errors[plan.rank] = None
        except BaseException as error:  # recorded for the test to inspect
            errors[plan.rank] = error
        ended[plan.rank] = time.monotonic() - start

    threads = [threading.Thread(target=body, args=(plan,)) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
        assert not t.is_alive(), "a participant hangs past its deadline"
    return errors, ended


CASES = [(op, name) for name, algo in ALGORITHMS.items() for op in algo.generators]


@pytest.mark.parametrize(("op", "algorithm"), CASES, ids=[f"{o}-{a}" for o, a in CASES])
def test_a_missing_participant_times_out(op: C, algorithm: str) -> None:
    p, missing, timeout = 4, 2, 0.5
    present = [r for r in range(p) if r != missing]
    # A scatter needs nothing from a non-root: its missing participant is the root.
    root = missing if op is C.SCATTER else 0
    plans = plans_for(op, algorithm, p, 64, present, root)
    errors, ended = run_in_threads(plans, InprocFabric(p), timeout)
    # Everyone who depends on the missing rank fails with the timeout type, in time.
    failed = {r: e for r, e in errors.items() if e is not None}
    assert failed, "nobody noticed the missing participant"
    for r, error in failed.items():
        assert isinstance(error, CollectiveTimeoutError), (r, error)
        assert isinstance(error, LpsyncError) and isinstance(error, TimeoutError)
        assert ended[r] < timeout + 1.0
    # Allreduce needs everyone's contribution: every present rank must fail.
    if op is C.ALLREDUCE:
        assert set(failed) == set(present)
    # Whoever waited on the missing rank itself says so.
    assert any(f"from rank {missing}" in str(e) for e in failed.values()), failed


def test_every_timeout_names_the_peer_it_waited_for() -> None:
    # LP broadcast from 0 over 0 -> 1 -> 2 -> 3, rank 2 missing: rank 1's send to 2 is
    # never consumed, rank 3's receive from 2 never arrives.
    p, missing = 4, 2
    errors, _ = run_in_threads(plans_for(C.BROADCAST, "lp", p, 64, [0, 1, 3]), InprocFabric(p), 0.3)
    assert isinstance(errors[1], CollectiveTimeoutError)
    for r in (1, 3):
        assert f"rank {missing}" in str(errors[r]), (r, str(errors[r]))


def test_abort_wakes_every_waiting_participant_promptly() -> None:
    p, timeout = 5, 20.0
    fabric = InprocFabric(p)
    plans = plans_for(C.ALLREDUCE, "ring", p, 1000, list(range(1, p)))  # rank 0 never comes
    cause = UnavailableError("peer 0 is gone")
    aborted_at: list[float] = []

    def abort_later() -> None:
        time.sleep(0.3)
        aborted_at.append(time.monotonic())
        fabric.abort(cause)

    start = time.monotonic()
    killer = threading.Thread(target=abort_later)
    killer.start()
    errors, ended = run_in_threads(plans, fabric, timeout)
    killer.join()
    for r in range(1, p):
        assert isinstance(errors[r], AbortedError), (r, errors[r])
        assert errors[r].__cause__ is cause
        assert start + ended[r] - aborted_at[0] < 0.5, "abort was not prompt"


def test_abort_before_start_fails_at_once() -> None:
    fabric = InprocFabric(2)
    fabric.abort(UnavailableError("gone"))
    plans = plans_for(C.BROADCAST, "lp", 2, 10, [0, 1])
    errors, ended = run_in_threads(plans, fabric, 10.0)
    assert all(isinstance(e, AbortedError) for e in errors.values()), errors
    assert max(ended.values()) < 1.0


def deadlocking_schedule() -> Schedule:
    """Two ranks that each wait for the other's message before sending their own."""
    b = ScheduleBuilder(C.BROADCAST, "deadlock", 2, 4)
    for rank in (0, 1):
        b.recv(0, rank, 1 - rank, Buf.OUT, 0, 4)
        b.send(1, rank, 1 - rank, Buf.OUT, 0, 4)
    b.copy(2, 0, Buf.OUT, 0, 4, Buf.IN, 0)
    return b.build()


def test_local_group_raises_the_timeout_and_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    s = deadlocking_schedule()
    pairs = [layout(C.BROADCAST, r, 2, 4, np.zeros(4, np.int32), False) for r in range(2)]
    timeout = 0.3
    with LocalGroup(s, pairs, None) as group:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            group.run(timeout)
        assert time.monotonic() - start < timeout + 1.0
    assert set(threading.enumerate()) <= before


def test_local_group_close_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    p, count = 9, 100
    s = generate(C.ALLREDUCE, "lp", p, count, 0, 4)
    pairs = [layout(C.ALLREDUCE, r, p, count, np.ones(count, np.float64), False) for r in range(p)]
    group = LocalGroup(s, pairs, Reduction(ReduceOp.SUM, np.dtype(np.float64), p))
    group.run(10.0)
    group.run(10.0)
    assert all(np.all(out == p) for _, out in pairs)
    group.close()
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "nope"}, "unknown algorithm"),
        ({"algorithm": "ring", "op": C.BROADCAST}, "has no"),
        ({"algorithm": "lp", "op": C.ALLGATHER}, "has no"),
        ({"participants": 0}, "participants"),
        ({"participants": -3}, "participants"),
        ({"root": -1}, "root"),
        ({"root": 4}, "root"),
        ({"count": -1}, "count"),
        ({"chunks": 0}, "chunks"),
        ({"chunks": -2, "algorithm": "mst"}, "chunks"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {
        "op": C.BROADCAST,
        "algorithm": "lp",
        "participants": 4,
        "count": 10,
        "root": 0,
        "chunks": 1,
        **kwargs,
    }
    with pytest.raises(InvalidArgumentError, match=match):
        generate(**args)


def test_plan_rejects_bad_buffers() -> None:
    p, count = 3, 10
    s = generate(C.ALLGATHER, "ring", p, count)
    red = Reduction(ReduceOp.SUM, np.dtype(np.int32), p)
    good_in, good_out = np.zeros(count, np.int32), np.zeros(p * count, np.int32)
    Plan(s, 0, (good_in, good_out), red)  # the right shapes pass
    bad = [
        (np.zeros(count + 1, np.int32), good_out),  # IN too long
        (good_in, np.zeros(count, np.int32)),  # OUT of one block, not P
        (good_in, np.zeros(p * count, np.int64)),  # dtypes differ
        (good_in.astype(np.float32), good_out),
        (good_in.reshape(2, 5), good_out),  # not 1-D
        (np.zeros(2 * count, np.int32)[::2], good_out),  # not contiguous
    ]
    for inp, out in bad:
        with pytest.raises(InvalidArgumentError):
            Plan(s, 0, (inp, out), red)


def test_plan_of_a_reduction_needs_a_reduce_op() -> None:
    s = generate(C.ALLREDUCE, "ring", 3, 9)
    with pytest.raises(InvalidArgumentError, match="reduce op"):
        Plan(s, 0, (np.zeros(9, np.int32), np.zeros(9, np.int32)), None)


class _FailingReduction(Reduction):
    """A reduction whose first combine raises, as a broken reduce kernel would."""

    def combine(self, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray) -> None:
        with _FAIL_LOCK:
            first = not _FAILED
            _FAILED.append(True)
        if first:
            raise ArithmeticError("reduce kernel failed")
        super().combine(acc, incoming, out)


_FAIL_LOCK = threading.Lock()
_FAILED: list[bool] = []


def test_a_failing_participant_releases_the_others_at_once() -> None:
    _FAILED.clear()
    p, count, timeout = 6, 1000, 20.0
    s = generate(C.ALLREDUCE, "lp", p, count, 0, 8)
    pairs = [layout(C.ALLREDUCE, r, p, count, np.ones(count, np.float32), False) for r in range(p)]
    before = set(threading.enumerate())
    with LocalGroup(s, pairs, _FailingReduction(ReduceOp.SUM, np.dtype(np.float32), p)) as g:
        start = time.monotonic()
        with pytest.raises(ArithmeticError, match="reduce kernel failed"):
            g.run(timeout)
        assert time.monotonic() - start < 2.0, "the others waited for the timeout"
        # The plans stay usable: the next run (no failure now) succeeds.
        g.run(timeout)
        assert all(np.all(out == p) for _, out in pairs)
    assert set(threading.enumerate()) <= before
