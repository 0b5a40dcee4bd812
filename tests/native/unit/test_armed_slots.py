"""A job's plan slots (lpsync/native/armed.py): a step with more distinct collectives than
slots keeps the first ones armed instead of evicting each for the next (a cycle longer
than the slots would miss on every call); a plan idle for IDLE_SECONDS gives its slot up."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lpsync.native import armed, program
from lpsync.native import engine as native_engine
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp

SERIES = ("allreduce", "direct", "float32", 32, 1.0)


def _plans() -> tuple[armed.ArmedPlans, program.Program, list[np.ndarray]]:
    assert native_engine() is not None, "the native engine is not built (the install builds it)"
    plans = armed.ArmedPlans(2, (1e-3, 1.0), lambda *args: None)
    pairs = [(np.full(8, r + 1, np.float32), np.zeros(8, np.float32)) for r in range(2)]
    compiled = program.direct(
        Collective.ALLREDUCE, 0, pairs, Reduction(ReduceOp.SUM, np.dtype(np.float32), 2), 8
    )
    return plans, compiled, program.flatten(pairs)


def _fill(plans: armed.ArmedPlans, compiled: program.Program, views: list[np.ndarray]) -> list:
    slots = native_engine().MAX_PLANS
    filled = [plans.arm(("k", i), compiled, views, 5.0, (), SERIES) for i in range(slots)]
    assert all(p is not None for p in filled)
    return filled


def test_every_slot_in_use_leaves_a_new_plan_on_the_general_path() -> None:
    plans, compiled, views = _plans()
    try:
        _fill(plans, compiled, views)
        assert plans.arm(("new",), compiled, views, 5.0, (), SERIES) is None
        assert plans.find(("k", 0)) is not None  # nothing evicted
        assert plans.armed() == native_engine().MAX_PLANS
    finally:
        plans.close()


def test_an_idle_plan_gives_its_slot_and_a_busy_one_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(armed, "IDLE_SECONDS", 0.5)
    monkeypatch.setattr(armed, "_SCAN_EVERY", 0.0)
    plans, compiled, views = _plans()
    try:
        filled = _fill(plans, compiled, views)
        assert plans.arm(("early",), compiled, views, 5.0, (), SERIES) is None  # none idle yet
        time.sleep(0.6)
        assert plans.arm(("warm-up",), compiled, views, 5.0, (), SERIES) is not None
        assert plans.find(("k", 0)) is None  # the oldest idle one went
        busy = filled[1]
        assert plans.run(busy)  # the engine runs it: in use since the last look
        np.testing.assert_array_equal(views[1], np.full(8, 3, np.float32))
        assert plans.arm(("next",), compiled, views, 5.0, (), SERIES) is not None
        assert plans.find(("k", 1)) is busy  # kept
        assert plans.find(("k", 2)) is None  # the oldest idle one went instead
    finally:
        plans.close()
