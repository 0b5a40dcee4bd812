"""The executor's receives posted ahead (PostingEndpoint), on a transport where a posted
receive really lands early: each one is taken off the inproc fabric by a thread of its
own as soon as its message is sent, while the participant goes on with earlier steps.
A receive posted while an earlier step still reads or writes its span would corrupt the
result, so every algorithm and op is checked against numpy, out of place and in place."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from lpsync.engine.executor import Plan
from lpsync.errors import CollectiveTimeoutError, LpsyncError
from lpsync.transport.inproc import InprocEndpoint, InprocFabric
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    C,
    PlannedCase,
    planned_cases,
    swap_schedule,
)


class _Early:
    def __init__(self, endpoint: InprocEndpoint, peer: int, tag: int, out: np.ndarray) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._take, args=(endpoint, peer, tag, out), daemon=True)
        self._thread.start()

    def _take(self, endpoint: InprocEndpoint, peer: int, tag: int, out: np.ndarray) -> None:
        try:
            endpoint.recv_into(peer, tag, out, time.monotonic() + 30)
        except BaseException as error:
            self.error = error

    def wait(self, deadline: float) -> None:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise CollectiveTimeoutError("posted receive did not land")
        if self.error is not None:
            raise self.error


class PostingInproc:
    def __init__(self, fabric: InprocFabric, rank: int) -> None:
        self._fabric, self._inner = fabric, fabric.endpoint(rank)
        self.rank, self.size = rank, fabric.size
        self.posted = 0

    def send(self, peer: int, tag: int, data: np.ndarray):  # type: ignore[no-untyped-def]
        return self._inner.send(peer, tag, data)

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        self._inner.recv_into(peer, tag, out, deadline)

    @contextmanager
    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float) -> Iterator[np.ndarray]:
        with self._inner.recv_borrow(peer, tag, nbytes, deadline) as raw:
            yield raw

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> _Early:
        self.posted += 1
        return _Early(self._inner, peer, tag, out)

    def abort(self, error: BaseException) -> None:
        self._fabric.abort(error if isinstance(error, LpsyncError) else LpsyncError(repr(error)))


def run_posting(case: PlannedCase, kind: type[PostingInproc] = PostingInproc) -> int:
    plans = case.plans
    p = len(plans)
    fabric = InprocFabric(p)
    endpoints = [kind(fabric, r) for r in range(p)]
    errors: list[BaseException] = []

    def participant(r: int) -> None:
        try:
            plans[r].run(endpoints[r], time.monotonic() + 30)
        except BaseException as error:
            errors.append(error)
            fabric.abort(LpsyncError(repr(error)))

    threads = [threading.Thread(target=participant, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    case.check()
    return sum(e.posted for e in endpoints)


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_receives_posted_ahead_give_numpy_results(op: C, algorithm: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"posting-{op}-{algorithm}".encode()))
    posted = 0
    for p in (2, 3, 5, 8):
        for case in planned_cases(op, algorithm, p, rng):
            posted += run_posting(case)
    assert posted > 0  # the look-ahead was exercised, not bypassed


def test_a_receive_is_not_posted_over_a_span_still_to_be_sent() -> None:
    """The swap (collective_cases.swap_schedule): rank 0's receive must wait for its send."""
    n = 100_000
    schedule = swap_schedule(n)
    for _ in range(10):  # the hazard is a race: give it chances
        fabric = InprocFabric(2)
        ins = [np.zeros(schedule.in_elements(r), np.int64) for r in (0, 1)]
        ins[1][:n] = 2
        outs = [np.full(n, 1, np.int64), np.zeros(n, np.int64)]
        endpoints = [PostingInproc(fabric, r) for r in (0, 1)]
        threads = [
            threading.Thread(
                target=Plan(schedule, r, (ins[r], outs[r])).run, args=(endpoints[r], time.monotonic() + 10)
            )
            for r in (0, 1)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert (outs[0] == 2).all() and (outs[1] == 1).all()
        assert endpoints[1].posted == 1  # rank 1 posts: nothing of its own is in the way
