"""A job's plan cache holds a bounded number of bytes, not only of plans: the tuner's
trials build a plan per candidate, each with its own scratch (TMP, receive slots)."""

from __future__ import annotations

import threading

import numpy as np

from lpsync.algorithms.registry import generate
from lpsync.algorithms.schedule import Kind
from lpsync.daemon.collectives import plans
from lpsync.daemon.collectives.plans import GroupCache
from lpsync.engine.executor import RECV_WINDOW
from lpsync.engine.group import LocalGroup, layout
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp


class _Held:
    """A cached plan of ``nbytes`` that records its close."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.closed = False

    def close(self, wait: bool = True) -> None:
        self.closed = True


def _fill(cache: GroupCache, sizes: list[int]) -> list[_Held]:
    made = [_Held(n) for n in sizes]
    for i, plan in enumerate(made):
        assert cache.get(("key", i), lambda plan=plan: plan) is plan
    return made


def test_the_least_recently_used_go_once_the_bytes_exceed_the_bound() -> None:
    third = plans._CACHE_BYTES // 3 + 1
    cache = GroupCache()
    first, second, third_plan = _fill(cache, [third, third, third])[:3]
    # Three thirds and a byte are over the bound: the oldest went, the newest two stay.
    assert first.closed and not second.closed and not third_plan.closed
    assert cache.held_bytes() == 2 * third
    # A hit makes a plan the most recently used: the next eviction takes the other.
    assert cache.get(("key", 1), lambda: _Held(0)) is second
    newest = _Held(third)
    cache.get(("key", 9), lambda: newest)
    assert third_plan.closed and not second.closed and not newest.closed
    cache.close()
    assert second.closed and newest.closed


def test_a_plan_larger_than_the_bound_stays_alone_and_small_ones_by_count() -> None:
    cache = GroupCache()
    small = _fill(cache, [1] * 3)
    huge = _Held(2 * plans._CACHE_BYTES)
    cache.get("huge", lambda: huge)
    assert all(p.closed for p in small) and not huge.closed
    assert cache.held_bytes() == huge.nbytes
    # Plans that hold nothing are bounded by the count alone.
    cache = GroupCache()
    free = _fill(cache, [0] * (plans._CACHE_SIZE + 2))
    assert [p.closed for p in free] == [True, True] + [False] * plans._CACHE_SIZE


def test_a_local_group_counts_its_tmp_and_receive_slots() -> None:
    before = set(threading.enumerate())
    p, count = 4, 1 << 16
    schedule = generate(Collective.REDUCE, "lp", p, count, 0, 8)
    data = [np.arange(count, dtype=np.float32) + r for r in range(p)]
    pairs = [layout(Collective.REDUCE, r, p, count, data[r], False) for r in range(p)]
    with LocalGroup(schedule, pairs, Reduction(ReduceOp.SUM, np.dtype(np.float32), p)) as group:
        group.run(10.0)
        assert np.array_equal(pairs[0][1], np.sum(data, axis=0))
        # Each participant: its TMP, and a window of slots as large as the largest message
        # it reduces (none where it reduces nothing it receives: the root's input rank).
        expected = 0
        for rank in range(p):
            reduced = [
                hi - lo for kind, _, _, lo, hi, *_ in schedule.program(rank) if kind == Kind.RECV_REDUCE
            ]
            expected += schedule.tmp_elements * 4 + 4 * max(reduced, default=0) * RECV_WINDOW
        assert group.nbytes == expected > schedule.tmp_elements * 4 * p
    assert set(threading.enumerate()) <= before


def test_arming_drops_the_general_plans_of_the_same_collective_on_the_same_buffers() -> None:
    cache = GroupCache()
    spec, other_spec, here, there = "spec", "other", ((1, 2),), ((3, 4),)
    trials = [_Held(1) for _ in range(3)]
    for chunks, plan in enumerate(trials):  # the tuner's trials: (spec, schedule, where, ...)
        cache.get((spec, ("lp", chunks), here, 7, ("s", 1)), lambda plan=plan: plan)
    elsewhere = _Held(1)  # the same spec on other buffers (another bucket), and another op
    cache.get((spec, ("lp", 1), there, 7, ("s", 2)), lambda: elsewhere)
    other = _Held(1)
    cache.get((other_spec, ("lp", 1), here, 7, ("s", 1)), lambda: other)
    cache.drop_others((spec, ("across", "lp", 1), here, ("s", 1)))
    assert all(p.closed for p in trials) and not elsewhere.closed and not other.closed
    assert cache.held_bytes() == 2
