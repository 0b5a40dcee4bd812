"""The one-shot plan (lpsync.engine.oneshot) on the emulated device: one launch per output
device, replayed run after run; refused where a launch would overwrite another's input."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lpsync.engine.device_group import DeviceContext
from lpsync.engine.oneshot import OneShot, Refused, plan, refusal
from lpsync.errors import InvalidArgumentError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span, Topology
from lpsync.reduction import Reduction
from lpsync.types import ReduceOp


@pytest.fixture
def context():
    ctx = DeviceContext(EmulatedKind(3, Topology.uniform(3)))
    yield ctx
    ctx.close()
    ctx.kind.close_kind()


def _span(context: DeviceContext, device: int, values: np.ndarray, keep: list) -> Span:
    memory = context.kind.allocate(device, values.nbytes)
    keep.append(memory)
    memory.array[:] = values.view(np.uint8)
    return Span(memory, 0, values.size, values.dtype)


def test_device_speed_oneshot_plan_replays_per_device(context) -> None:
    keep: list = []
    devices = [0, 1, 0, 2]
    rng = np.random.default_rng(1)
    kind = context.kind
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float64), 4)
    pairs = []
    for d in devices:
        pairs.append((_span(context, d, np.zeros(500), keep), _span(context, d, np.zeros(500), keep)))
    plan = OneShot(context, pairs, reduction)
    assert len(plan.all_streams()) == 3  # one launch per output device
    for _ in range(3):  # replayed: new inputs each run, the same operations
        inputs = [rng.normal(size=500) for _ in devices]
        for (inp, _), x in zip(pairs, inputs, strict=True):
            kind.write(inp, x)
        want = ((inputs[0] + inputs[1]) + inputs[2]) + inputs[3]
        plan.run(time.monotonic() + 30)
        for _, out in pairs:
            assert kind.read(out).tobytes() == want.tobytes()
    plan.close()


def test_device_speed_oneshot_plan_refuses_in_place_across_devices(context) -> None:
    keep: list = []
    reduction = Reduction(ReduceOp.MAX, np.dtype(np.int32), 2)
    a = _span(context, 0, np.arange(8, dtype=np.int32), keep)
    b = _span(context, 1, np.arange(8, dtype=np.int32), keep)
    assert refusal(context, [(a, a), (b, b)], reduction.dtype) is not None
    with pytest.raises(InvalidArgumentError):
        OneShot(context, [(a, a), (b, b)], reduction)
    refused = plan(context, [(a, a), (b, b)], reduction)  # what the daemon caches: the chain runs
    assert isinstance(refused, Refused) and "overlaps" in refused.why
    c = _span(context, 0, np.arange(8, dtype=np.int32)[::-1].copy(), keep)
    assert refusal(context, [(a, a), (c, c)], reduction.dtype) is None  # one device: in place is fine
    OneShot(context, [(a, a), (c, c)], reduction).run(time.monotonic() + 30)
    want = np.maximum(np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32)[::-1])
    assert context.kind.read(a).tolist() == context.kind.read(c).tolist() == want.tolist()
