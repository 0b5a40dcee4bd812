"""Child-process side of the UCX transport tests (spawned: it must be importable).

Each participant connects a UcxEndpoint over TCP, runs the cases it is given with
Plan.run and puts ("result", rank, case index, OUT) or ("error", rank, type, message,
seconds since start of the case) on the queue; the parent checks against numpy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

TCP = "tcp"


@dataclass(frozen=True)
class Case:
    op: str
    algorithm: str
    count: int
    root: int = 0
    chunks: int = 1
    dtype: str = "float32"
    reduce_op: str = "sum"
    seed: int = 0


def case_inputs(case: Case, participants: int) -> list[np.ndarray]:
    """Every rank's input, the same on the parent and in every child."""
    from lpsync.types import Collective, ReduceOp, dtype_of
    from tests.collective_cases import make_inputs

    rng = np.random.default_rng(case.seed)
    return make_inputs(
        Collective(case.op), participants, case.count, dtype_of(case.dtype), ReduceOp(case.reduce_op), rng
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def participant(
    rank: int,
    peers: str,
    secret: bytes,
    cases: list[Case],
    queue: Queue[Any],
    mode: str = "run",
    connect_timeout: float = 20.0,
    timeout: float = 20.0,
    go: Any = None,
    transport: str = "ucx",
) -> None:
    """mode: run (the cases), idle (report CPU seconds over 2 s idle after the cases),
    hang (connect, report, then sleep: the parent kills it), recv_timeout (a receive
    nobody sends: expect CollectiveTimeoutError), notice_loss (idle 3 s while the
    parent kills rank 1, then receive from it), heal (on a runtime of its own, as a
    daemon holds one: once the parent has killed rank 1, rebuild the mesh on the same
    runtime with its replacement and run the cases). ``go``: an Event to wait for
    before anything binds (a replacement started ahead of the kill of the rank it
    replaces)."""
    import faulthandler
    import signal

    faulthandler.enable(all_threads=True)  # a crash in native code leaves its stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's post-mortem
    records = _Records()
    logging.getLogger("lpsync").addHandler(records)
    from lpsync.algorithms import generate
    from lpsync.engine.executor import Plan
    from lpsync.errors import LpsyncError
    from lpsync.reduction import Reduction
    from lpsync.transport import backends
    from lpsync.transport.addresses import parse_peers
    from lpsync.transport.mesh import MeshOptions
    from lpsync.types import Collective, ReduceOp, dtype_of

    if go is not None and not go.wait(120):  # started early: imports done, port not bound
        return
    options = MeshOptions(
        rank, tuple(parse_peers(peers)), secret, connect_timeout=connect_timeout, close_timeout=5.0
    )
    # heal: one runtime outlives the broken endpoint, as the daemon's peer manager holds it.
    runtime = backends.open_runtime(transport, options.peers[rank].port, TCP) if mode == "heal" else None
    start = time.monotonic()
    try:
        endpoint = backends.connect(transport, options, runtime, TCP)
    except LpsyncError as error:
        queue.put(("error", rank, type(error).__name__, str(error), time.monotonic() - start, records.lines))
        return
    queue.put(("connected", rank))
    try:
        if mode == "hang":
            time.sleep(120)
        if mode == "heal":
            give_up = time.monotonic() + 20
            while endpoint.error is None and time.monotonic() < give_up:
                time.sleep(0.05)
            queue.put(("broken", rank, None if endpoint.error is None else str(endpoint.error)))
            endpoint.close()
            # Nothing forms for a while: the replacement's dials are dropped and retried.
            time.sleep(2.0)
            start = time.monotonic()
            endpoint = backends.connect(transport, options, runtime, TCP)
            queue.put(("reconnected", rank, time.monotonic() - start))
        if mode == "notice_loss":
            # Idle while the parent kills rank 1; the close callback alone must have
            # broken the endpoint, so this receive fails at once, not at its deadline.
            time.sleep(3.0)
            queue.put(("noticed", rank, None if endpoint.error is None else str(endpoint.error)))
            start = time.monotonic()
            try:
                endpoint.recv_into(1, 7, np.empty(4, np.uint8), start + 10.0)
            except LpsyncError as error:
                queue.put(
                    ("error", rank, type(error).__name__, str(error), time.monotonic() - start, records.lines)
                )
            return
        if mode == "recv_timeout":
            start = time.monotonic()
            try:
                endpoint.recv_into(1 - rank, 999, np.empty(4, np.uint8), start + 1.0)
            except LpsyncError as error:
                queue.put(
                    ("error", rank, type(error).__name__, str(error), time.monotonic() - start, records.lines)
                )
            return
        for index, case in enumerate(cases):
            op, dtype = Collective(case.op), dtype_of(case.dtype)
            schedule = generate(op, case.algorithm, endpoint.size, case.count, case.root, case.chunks)
            inp = case_inputs(case, endpoint.size)[rank]
            out = np.zeros(schedule.out_elements(rank), dtype)
            plan = Plan(schedule, rank, (inp, out), Reduction(ReduceOp(case.reduce_op), dtype, endpoint.size))
            start = time.monotonic()
            try:
                # A fresh tag space per case: nothing of one case can match another's.
                plan.run(endpoint, start + timeout, tag_base=index << 32)
            except LpsyncError as error:
                queue.put(
                    ("error", rank, type(error).__name__, str(error), time.monotonic() - start, records.lines)
                )
                return
            queue.put(("result", rank, index, out))
        if mode == "idle":
            before = os.times()
            time.sleep(2.0)
            after = os.times()
            queue.put(("idle", rank, (after.user - before.user) + (after.system - before.system)))
    finally:
        closing = time.monotonic()
        endpoint.close()
        if runtime is not None:
            runtime.close()
        closing = time.monotonic() - closing
        # Python threads still alive besides ours and the queue's own feeder thread.
        # _DummyThread entries stand for foreign (C++) threads that once called into
        # Python; Python never forgets them, so they are not evidence of a leak.
        leaked = [
            t.name
            for t in threading.enumerate()
            if t is not threading.main_thread()
            and "Feeder" not in t.name
            and not isinstance(t, threading._DummyThread)
        ]
        queue.put(("closed", rank, records.lines, leaked, closing))
