"""The pinned host rings of multi-node device collectives come from one pool per daemon,
bounded in bytes (second reading, point 9): before, each job kept its own ring in its plan
cache, beside its host mirrors, so N jobs pinned N rings and a job's mirror churn evicted
its ring, to be allocated again (cudaHostAlloc) at its next collective."""

from __future__ import annotations

import threading
import time

import numpy as np

from lpsync.daemon.collectives.plans import GroupCache
from lpsync.engine.staging import RING_SLOTS, HostMirrors, RingPool
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span

SLOT = 64 << 10
RING = RING_SLOTS * SLOT


class CountingKind(EmulatedKind):
    """The emulated device, counting pinned host allocations (cudaHostAlloc's)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.host_allocations = 0

    def allocate_host(self, nbytes: int, device: int | None = None):
        self.host_allocations += 1
        return super().allocate_host(nbytes, device)


def test_cuda_contract_rings_are_bounded_per_daemon_and_reused_across_jobs():
    kind = CountingKind()
    pool = RingPool(kind, budget=2 * RING, slots=RING_SLOTS, patience=5.0)
    try:
        for _ in range(5):  # jobs one after another: one ring serves them all
            for job in ("a", "b", "c"):
                rings = pool.lease((job,), SLOT, [0], time.monotonic() + 10)
                pool.give_back(rings, (job,))
        assert pool.allocated == 1 and kind.host_allocations == RING_SLOTS
        a = pool.lease(("a",), SLOT, [0], time.monotonic() + 10)
        b = pool.lease(("b",), SLOT, [1], time.monotonic() + 10)
        assert pool.held_bytes == 2 * RING  # the budget: a third job waits for a ring
        got: list = []
        third = threading.Thread(
            target=lambda: got.append(pool.lease(("c",), SLOT, [0], time.monotonic() + 10))
        )
        third.start()
        time.sleep(0.3)
        assert not got, "a lease over the daemon's budget did not wait"
        pool.give_back(a, ("a",))
        third.join(5)
        assert got and got[0][0] is a[0]  # a's ring, not a new one
        assert pool.allocated == 2 and pool.held_bytes == 2 * RING and pool.over_budget == 0
        pool.give_back(got[0], ("c",))
        pool.give_back(b, ("b",))
        mine = pool.lease(("b",), SLOT, [0], time.monotonic() + 10)
        assert mine[0] is b[0], "a job gets its own ring back (its plans are bound to it)"
        pool.give_back(mine, ("b",))
    finally:
        pool.close()
        kind.close_kind()


def test_cuda_contract_a_jobs_mirror_churn_leaves_the_pooled_ring_alone():
    """The old ring lived in the job's plan cache (GroupCache.mirrors, 8 entries): nine
    mirrors of other buffers evicted it. The pool's ring is not in that cache."""
    kind = CountingKind()
    pool = RingPool(kind, budget=RING, slots=RING_SLOTS)
    plans = GroupCache()
    try:
        first = pool.lease(("job",), SLOT, [0], time.monotonic() + 10)
        pool.give_back(first, ("job",))
        device = kind.allocate(0, 1 << 16)
        for i in range(9):  # the flat path's mirrors of nine buffers
            span = Span(device, 0, 4096 + i, np.dtype(np.uint8))
            plans.mirrors((i, ()), lambda span=span: HostMirrors(kind, [span]))
        again = pool.lease(("job",), SLOT, [0], time.monotonic() + 10)
        assert again[0] is first[0] and again[0].mirrors, "the ring was freed or allocated again"
        assert pool.allocated == 1
        pool.give_back(again, ("job",))
    finally:
        plans.close()
        pool.close()
        kind.close_kind()


def test_cuda_contract_a_ring_lease_never_deadlocks_on_a_full_budget():
    """Two nodes lease independently, so a full budget must not hold a collective forever
    (two jobs could each wait on the other's node): past its patience a lease takes a ring
    over the budget, freed when given back; other sizes' idle rings make room first."""
    kind = CountingKind()
    pool = RingPool(kind, budget=RING, slots=RING_SLOTS, patience=0.2)
    try:
        held = pool.lease(("a",), SLOT, [0], time.monotonic() + 10)
        started = time.monotonic()
        extra = pool.lease(("b",), SLOT, [0], time.monotonic() + 10)
        assert 0.15 <= time.monotonic() - started < 2.0
        assert pool.over_budget == 1 and pool.held_bytes == RING
        pool.give_back(extra, ("b",))
        assert kind.releaser.flush(5) and not extra[0].mirrors  # freed, not kept
        pool.give_back(held, ("a",))
        small = pool.lease(("c",), SLOT // 2, [0] * 2, time.monotonic() + 10)  # two rings, at once
        assert held[0].mirrors == [] and kind.releaser.flush(5)  # the idle ring made room
        assert pool.over_budget == 1 and pool.held_bytes == RING
        pool.give_back(small, ("c",))
    finally:
        pool.close()
        kind.close_kind()
