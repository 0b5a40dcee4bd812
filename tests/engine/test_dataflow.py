"""Programs run as data flow (lpsync.engine.dataflow) on real TCP endpoints over
loopback, in process: every op and algorithm against numpy, out of place and in place;
the dependencies that keep a receive off a span still being sent; a peer lost mid-run,
a timeout and a failing reduction, each failing the run at once with its own error, the
endpoint broken and no connection thread left behind."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine import dataflow
from lpsync.engine.executor import Plan
from lpsync.errors import CollectiveTimeoutError, UnavailableError
from lpsync.reduction import Reduction
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.mesh import MeshOptions
from lpsync.transport.tcp import TcpEndpoint
from lpsync.types import ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    C,
    planned_cases,
    swap_schedule,
)
from tests.ports import free_ports

SECRET = b"dataflow test secret"


def _tcp_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("lpsync-tcp")}


@contextmanager
def mesh(n: int) -> Iterator[list[TcpEndpoint]]:
    """n connected endpoints in this process; afterwards no connection thread is left."""
    peers = tuple(PeerAddress("127.0.0.1", port) for port in free_ports(n))
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(TcpEndpoint.connect, MeshOptions(r, peers, SECRET, connect_timeout=20.0))
            for r in range(n)
        ]
        endpoints = [f.result() for f in futures]
    try:
        yield endpoints
    finally:
        with ThreadPoolExecutor(n) as pool:  # close is collective: all at once
            list(pool.map(lambda e: e.close(), endpoints))
    deadline = time.monotonic() + 10
    while _tcp_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tcp_threads() == set()


@pytest.fixture
def flows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the runs that went as data flow."""
    started: list[int] = []
    start = dataflow.Run.start

    def counting(self: dataflow.Run) -> None:
        started.append(1)
        start(self)

    monkeypatch.setattr(dataflow.Run, "start", counting)
    return started


def _run_all(endpoints: list[TcpEndpoint], plans: list[Plan], tag_base: int, timeout: float = 30) -> list:
    """Run every plan at once; each participant's exception (or None)."""

    def one(r: int) -> BaseException | None:
        try:
            plans[r].run(endpoints[r], time.monotonic() + timeout, tag_base)
        except BaseException as error:
            return error
        return None

    with ThreadPoolExecutor(len(plans)) as pool:
        return list(pool.map(one, range(len(plans))))


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_every_op_and_algorithm_gives_numpy_results(op: C, algorithm: str, flows: list[int]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"dataflow-{op}-{algorithm}".encode()))
    runs = tag = 0
    for p in (2, 3, 5):
        with mesh(p) as endpoints:
            for case in planned_cases(op, algorithm, p, rng):
                runs += sum(plan._flow is not None for plan in case.plans)
                tag += 1
                assert _run_all(endpoints, case.plans, tag << 20) == [None] * p
                case.check()
    # Every plan whose spans line up ran as data flow (BE's halving ones do not).
    assert len(flows) == runs
    if algorithm != "be":
        assert runs > 0


def test_spans_that_overlap_unequally_are_left_to_the_sequential_run() -> None:
    """BE's broadcast halves its spans (a write overlapping a larger read-write span):
    no flow. A ring's chunks line up: a flow whose sends wait for the reduces they send."""
    buffers = (np.zeros(1000, np.int64), np.zeros(1000, np.int64))
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.int64), 4)
    assert Plan(generate(C.BROADCAST, "be", 4, 1000, 0, 1), 1, buffers)._flow is None
    plan = Plan(generate(C.ALLREDUCE, "ring", 4, 1000, 0, 2), 1, buffers, reduction)
    flow = plan._flow
    assert flow is not None
    for i, step in enumerate(plan._steps):
        if step.kind == 2:  # a reduce: the send of its span waits for it
            sends = [j for j in flow.then[i] if plan._steps[j].kind == 0]
            assert [(plan._steps[j].lo, plan._steps[j].hi) for j in sends] in ([], [(step.lo, step.hi)])
    assert flow.waits.count(0) >= 1  # something starts at once


def test_a_receive_waits_for_the_send_of_its_span(flows: list[int]) -> None:
    """The swap (collective_cases.swap_schedule): rank 0's receive must wait for its send."""
    n = 1 << 20  # 8 MiB of int64: past the socket buffers, so the send takes a while
    schedule = swap_schedule(n)
    flow = Plan(schedule, 0, (np.zeros(schedule.in_elements(0), np.int64), np.zeros(n, np.int64)))._flow
    assert flow is not None and flow.then[0] == (1,) and flow.waits == (0, 1)  # the receive waits
    with mesh(2) as endpoints:
        for round_ in range(5):  # the hazard is a race: give it chances
            ins = [np.zeros(schedule.in_elements(r), np.int64) for r in (0, 1)]
            ins[1][:n] = 2
            outs = [np.full(n, 1, np.int64), np.zeros(n, np.int64)]
            plans = [Plan(schedule, r, (ins[r], outs[r])) for r in (0, 1)]
            assert _run_all(endpoints, plans, (round_ + 1) << 20) == [None, None]
            assert (outs[0] == 2).all() and (outs[1] == 1).all()
    assert len(flows) == 10


def _ring_plans(
    p: int, count: int, reduction: Reduction | None = None
) -> tuple[list[Plan], list[np.ndarray]]:
    schedule = generate(C.ALLREDUCE, "ring", p, count, 0, 4)
    reduction = reduction or Reduction(ReduceOp.SUM, np.dtype(np.float32), p)
    outs = [np.full(count, r, np.float32) for r in range(p)]
    return [Plan(schedule, r, (outs[r], outs[r]), reduction) for r in range(p)], outs


def test_a_peer_lost_mid_run_fails_the_others_at_once(flows: list[int]) -> None:
    """Rank 2 never runs and its endpoint breaks a second in: ranks 0 and 1, waiting on
    their ring, fail with UnavailableError naming the lost peer well before their
    timeout, and their endpoints are broken (nothing lands in the buffers later)."""
    with mesh(3) as endpoints:
        plans, _ = _ring_plans(3, 3 << 20)
        box: dict[int, BaseException | None] = {}

        def one(r: int) -> None:
            try:
                plans[r].run(endpoints[r], time.monotonic() + 60, 1 << 20)
                box[r] = None
            except BaseException as error:
                box[r] = error

        threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(1.0)
        endpoints[2].abort(UnavailableError("rank 2 goes away"))
        endpoints[2]._close_connections()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a survivor hangs"
        assert time.monotonic() - started < 20
        for r in (0, 1):
            assert isinstance(box[r], UnavailableError), (r, box[r])
            assert endpoints[r].error is not None
    assert len(flows) == 2


def test_a_timeout_names_what_it_waited_for_and_breaks_the_endpoint(flows: list[int]) -> None:
    """Rank 1 never runs: rank 0's ring times out at its deadline, naming the first step
    not done (rank 1's message), and its endpoint is broken."""
    with mesh(2) as endpoints:
        plans, _ = _ring_plans(2, 1000)
        started = time.monotonic()
        with pytest.raises(
            CollectiveTimeoutError, match=r"participant 0 timed out waiting for .*participant 1"
        ):
            plans[0].run(endpoints[0], time.monotonic() + 0.5, 7 << 20)
        assert 0.4 < time.monotonic() - started < 5
        assert isinstance(endpoints[0].error, CollectiveTimeoutError)
    assert len(flows) == 1


class _Failing(Reduction):
    """A reduction that fails on the connection's thread, as a bug would."""

    def combine(self, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray) -> None:
        raise RuntimeError("reduction failed")


def test_a_step_that_raises_fails_the_run_not_the_connection_thread(flows: list[int]) -> None:
    """A reduce that raises on a reader: the run fails with that error on the
    collective's thread, at once, and the endpoint is broken for the others."""
    with mesh(2) as endpoints:
        plans, _ = _ring_plans(2, 1000, _Failing(ReduceOp.SUM, np.dtype(np.float32), 2))
        started = time.monotonic()
        errors = _run_all(endpoints, plans, 9 << 20, timeout=30)
        assert time.monotonic() - started < 10
        assert any(isinstance(e, RuntimeError) and "reduction failed" in str(e) for e in errors), errors
        assert all(e is not None for e in errors), errors
