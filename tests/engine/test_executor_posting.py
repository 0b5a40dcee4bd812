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
from typing import Any

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.algorithms.schedule import Buf, ScheduleBuilder
from lpsync.engine.executor import Plan
from lpsync.engine.group import layout
from lpsync.errors import CollectiveTimeoutError, LpsyncError
from lpsync.reduction import Reduction
from lpsync.transport.inproc import InprocEndpoint, InprocFabric
from lpsync.types import ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    C,
    assert_matches,
    chunk_options,
    in_place_buffer,
    in_place_options,
    make_inputs,
    reference,
    roots_for,
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


class _Relay:
    """A relayed receive's onward send: made by the receiving thread once it has the data."""

    def __init__(self, early: _Early) -> None:
        self.early = early
        self.sent: Any = None

    def done(self) -> bool:
        return self.sent is not None and bool(self.sent.done())

    def wait(self, deadline: float) -> None:
        self.early.wait(deadline)
        assert self.sent is not None
        self.sent.wait(deadline)


class RelayingInproc(PostingInproc):
    """PostingInproc that also relays (lpsync.engine.endpoint.RelayingEndpoint), on the
    thread that took the message, as the TCP backend's reader does."""

    def __init__(self, fabric: InprocFabric, rank: int) -> None:
        super().__init__(fabric, rank)
        self.relayed = 0

    def post_relay(self, peer: int, tag: int, out: np.ndarray, to_peer: int, to_tag: int):  # type: ignore[no-untyped-def]
        self.relayed += 1
        early = _Early.__new__(_Early)
        early.error = None
        onward = _Relay(early)

        def take_and_forward() -> None:
            early._take(self._inner, peer, tag, out)
            if early.error is None:
                onward.sent = self._inner.send(to_peer, to_tag, out)

        early._thread = threading.Thread(target=take_and_forward, daemon=True)
        early._thread.start()
        return early, onward


def run_posting(
    op: C,
    algorithm: str,
    p: int,
    root: int,
    count: int,
    chunks: int,
    in_place: bool,
    rng: np.random.Generator,
    kind: type[PostingInproc] = PostingInproc,
) -> int:
    schedule = generate(op, algorithm, p, count, root, chunks)
    inputs = make_inputs(op, p, count, np.dtype(np.int64), ReduceOp.SUM, rng, root)
    datas = [
        in_place_buffer(op, r, p, count, x, root) if in_place else x.copy() for r, x in enumerate(inputs)
    ]
    pairs = [layout(op, r, p, count, d, in_place, root) for r, d in enumerate(datas)]
    fabric = InprocFabric(p)
    endpoints = [kind(fabric, r) for r in range(p)]
    plans = [
        Plan(schedule, r, pair, Reduction(ReduceOp.SUM, np.dtype(np.int64), p))
        for r, pair in enumerate(pairs)
    ]
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
    want = reference(op, ReduceOp.SUM, inputs, root, count)
    what = f"{op}-{algorithm} P={p} root={root} count={count} chunks={chunks} in_place={in_place}"
    for r, (_, out) in enumerate(pairs):
        assert_matches(out, want[r], f"{what} rank {r}")
    return sum(getattr(e, "relayed", e.posted) for e in endpoints)


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_receives_posted_ahead_give_numpy_results(op: C, algorithm: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"posting-{op}-{algorithm}".encode()))
    posted = 0
    for p in (2, 3, 5, 8):
        for root in roots_for(op, p)[:2]:
            for count in (0, 7, 1001):
                for chunks in chunk_options(algorithm, (1, 4, 9)):
                    for in_place in in_place_options(op):
                        posted += run_posting(op, algorithm, p, root, count, chunks, in_place, rng)
    assert posted > 0  # the look-ahead was exercised, not bypassed


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_relayed_and_deferred_receives_give_numpy_results(op: C, algorithm: str) -> None:
    """A transport that relays: a middle node's chunks are sent on by the receiving
    thread, and receives nothing later touches are waited for only at the end."""
    rng = np.random.default_rng(zlib.crc32(f"relaying-{op}-{algorithm}".encode()))
    relayed = 0
    for p in (3, 5):
        for root in roots_for(op, p)[:2]:
            for count in (7, 1001):
                for chunks in chunk_options(algorithm, (1, 4, 40)):
                    for in_place in in_place_options(op):
                        relayed += run_posting(
                            op, algorithm, p, root, count, chunks, in_place, rng, RelayingInproc
                        )
    if (op, algorithm) in ((C.BROADCAST, "lp"), (C.ALLGATHER, "ring")):
        assert relayed > 0  # the pipelines that pass chunks through did relay


def test_pass_through_finds_the_chunks_a_node_only_forwards() -> None:
    """LP broadcast on 4 ranks from root 0: the middle ranks relay every chunk and wait for
    none in turn; the last only waits at the end; the root sends. A reduction has none."""
    schedule = generate(C.BROADCAST, "lp", 4, 1000, 0, 5)
    for rank in range(4):
        plan = Plan(schedule, rank, (np.zeros(1000, np.int64), np.zeros(1000, np.int64)))
        recvs = [i for i, s in enumerate(plan._steps) if s.kind == 1]
        assert plan._alone == frozenset(recvs), rank
        assert set(plan._relay_of) == (set(recvs) if rank in (1, 2) else set()), rank
        assert all(plan._steps[j].kind == 0 for j in plan._relay_of.values())
        assert len(recvs) == (0 if rank == 0 else 5)
    reduce = generate(C.ALLREDUCE, "lp", 4, 1000, 0, 5)
    buffers = (np.zeros(1000, np.int64), np.zeros(1000, np.int64))
    plan = Plan(reduce, 1, buffers, Reduction(ReduceOp.SUM, np.dtype(np.int64), 4))
    assert plan._relay_of == {} and plan._alone == frozenset()


def test_a_receive_is_not_posted_over_a_span_still_to_be_sent() -> None:
    """Rank 0 sends its OUT, then receives into it; rank 1 sends its IN at once, then
    receives rank 0's OUT. Posted before rank 0's send has gone, rank 0's receive would
    land rank 1's data in the span being sent, and rank 1 would get its own data back."""
    n = 100_000
    b = ScheduleBuilder(C.BROADCAST, "swap", 2, n)
    b.send(0, 0, 1, Buf.OUT, 0, n)
    b.recv(1, 0, 1, Buf.OUT, 0, n)
    b.send(0, 1, 0, Buf.IN, 0, n)
    b.recv(1, 1, 0, Buf.OUT, 0, n)
    schedule = b.build()
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
