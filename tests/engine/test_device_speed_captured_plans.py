"""Plans replayed, not re-issued (issue 47, item 2), on the emulated device: a launched
plan's operations are captured once (the emulated kind records them as a CUDA stream
capture would, across the plan's streams forked from and rejoined to the first) and each
later launch enqueues the captured program as one item. Checked bitwise against the same
plan issued operation by operation, and against numpy, for every op the device path
serves, every dtype and reduce op of allreduce, the one-shot kernel, and links staged
through host memory; a plan over other buffers is captured anew; a capture that CUDA
would refuse falls back to issuing, and says so in the log."""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext, DeviceGroup, StreamPlan
from lpsync.engine.group import layout
from lpsync.engine.oneshot import OneShot
from lpsync.memory.devices import parse_devices
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, OUT_OF_PLACE_ONLY, Collective, ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    REDUCING,
    assert_matches,
    in_place_buffer,
    make_inputs,
    out_elements,
    reference,
    roots_for,
)

C = Collective
DEVICES = [0, 1, 2, 3, 0]  # 1-2 staged through host memory, 0-3 PCIe, the rest NVLink; 0 shared
COUNT = 37
RUNS = 3


@pytest.fixture
def context():
    spec = parse_devices("emulated:4,host=1-2,slow=0-3")
    ctx = DeviceContext(EmulatedKind(4, spec.topology))
    yield ctx
    ctx.close()
    ctx.kind.close_kind()


def _buffers(kind, op, inputs, root, in_place, keep) -> list[tuple[Span, Span]]:
    p = len(inputs)
    pairs = []
    for r, x in enumerate(inputs):
        device = DEVICES[r]
        if in_place:
            data = in_place_buffer(op, r, p, COUNT, x, root)
            memory = kind.allocate(device, max(data.nbytes, 1))
            keep.append(memory)
            pairs.append(layout(op, r, p, COUNT, Span(memory, 0, data.size, data.dtype), True, root))
        else:
            size = out_elements(op, p, COUNT, r, root)
            spans = []
            for n in (x.size, size):
                memory = kind.allocate(device, max(n * x.dtype.itemsize, 1))
                keep.append(memory)
                spans.append(Span(memory, 0, n, x.dtype))
            pairs.append(tuple(spans))
    return pairs


def _load(kind, op, pairs, inputs, root, in_place) -> None:
    p = len(inputs)
    for r, ((inp, out), x) in enumerate(zip(pairs, inputs, strict=True)):
        if in_place:
            whole = Span(inp.memory, 0, inp.memory.nbytes // x.dtype.itemsize, x.dtype)
            kind.write(whole, in_place_buffer(op, r, p, COUNT, x, root))
        else:
            kind.write(inp, x)
            kind.write(out, np.zeros(out.count, x.dtype))


def _captured_against_issued(context, op, algorithm, dtype, reduce_op, p, in_place, seed) -> None:
    """RUNS launches of one plan (captured at the first, replayed after) against the same
    schedule issued op by op on other buffers (StreamPlan.run), fresh inputs each run."""
    kind, keep = context.kind, []
    rng = np.random.default_rng(seed)
    for root in roots_for(op, p):
        schedule = generate(op, algorithm, p, COUNT, root, 2)
        reduction = Reduction(reduce_op, dtype, p) if op in REDUCING else None
        inputs = make_inputs(op, p, COUNT, dtype, reduce_op, rng, root)
        captured_pairs = _buffers(kind, op, inputs, root, in_place, keep)
        issued_pairs = _buffers(kind, op, inputs, root, in_place, keep)
        captured = DeviceGroup(context, schedule, captured_pairs, reduction)
        issued = DeviceGroup(context, schedule, issued_pairs, reduction)
        captures, launches = kind.captures, kind.graph_launches
        for run in range(RUNS):
            inputs = make_inputs(op, p, COUNT, dtype, reduce_op, rng, root)
            _load(kind, op, captured_pairs, inputs, root, in_place)
            _load(kind, op, issued_pairs, inputs, root, in_place)
            captured.launch(("job",), time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
            issued.run(time.monotonic() + 30)
            want = reference(op, reduce_op, inputs, root, COUNT)
            for r, ((_, a), (_, b)) in enumerate(zip(captured_pairs, issued_pairs, strict=True)):
                got, plain = kind.read(a), kind.read(b)
                what = f"{op}/{algorithm} {dtype} {reduce_op} run {run} rank {r}"
                assert got.tobytes() == plain.tobytes(), f"{what}: the replay differs from the issued plan"
                assert_matches(got, want[r], what)
        assert kind.captures == captures + 1  # captured once, at the first launch
        assert kind.graph_launches == launches + RUNS  # every launch replays it
        captured.close()
        issued.close()
    for memory in keep:
        kind.free(memory)


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in"])
def test_device_speed_captured_every_schedule_replays_like_issued(context, op, algorithm, in_place):
    if in_place and op in OUT_OF_PLACE_ONLY:
        pytest.skip(f"{op} runs out of place only")
    _captured_against_issued(context, op, algorithm, np.dtype(np.float32), ReduceOp.SUM, 5, in_place, 3)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_device_speed_captured_allreduce_every_dtype_and_op(context, dtype):
    for reduce_op in ReduceOp:
        _captured_against_issued(context, C.ALLREDUCE, "ring", DTYPES[dtype], reduce_op, 3, False, 5)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_device_speed_captured_oneshot_replays_like_issued(dtype):
    context = DeviceContext(EmulatedKind(2))
    kind, keep, rng = context.kind, [], np.random.default_rng(9)
    try:
        for reduce_op in ReduceOp:
            pairs = {name: [] for name in ("captured", "issued")}
            for name in pairs:
                for device in (0, 1, 0):
                    spans = []
                    for _ in range(2):
                        memory = kind.allocate(device, COUNT * DTYPES[dtype].itemsize)
                        keep.append(memory)
                        spans.append(Span(memory, 0, COUNT, DTYPES[dtype]))
                    pairs[name].append(tuple(spans))
            reduction = Reduction(reduce_op, DTYPES[dtype], 3)
            captured = OneShot(context, pairs["captured"], reduction)
            issued = OneShot(context, pairs["issued"], reduction)
            for _ in range(RUNS):
                inputs = make_inputs(C.ALLREDUCE, 3, COUNT, DTYPES[dtype], reduce_op, rng, 0)
                for name in pairs:
                    for (inp, _), x in zip(pairs[name], inputs, strict=True):
                        kind.write(inp, x)
                captured.launch(("job",), time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
                issued.run(time.monotonic() + 30)
                for (_, a), (_, b) in zip(pairs["captured"], pairs["issued"], strict=True):
                    assert kind.read(a).tobytes() == kind.read(b).tobytes()
            captured.close()
            issued.close()
        assert kind.captures == len(ReduceOp) and kind.graph_launches == len(ReduceOp) * RUNS
    finally:
        context.close()
        kind.close_kind()


def test_device_speed_captured_plan_over_other_buffers_is_captured_anew(context) -> None:
    kind, keep = context.kind, []
    rng = np.random.default_rng(11)
    schedule = generate(C.ALLREDUCE, "ring", 3, COUNT, 0, 2)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float64), 3)
    inputs = make_inputs(C.ALLREDUCE, 3, COUNT, np.dtype(np.float64), ReduceOp.SUM, rng, 0)
    first = _buffers(kind, C.ALLREDUCE, inputs, 0, False, keep)
    second = _buffers(kind, C.ALLREDUCE, inputs, 0, False, keep)
    plans = [DeviceGroup(context, schedule, pairs, reduction) for pairs in (first, second)]
    _load(kind, C.ALLREDUCE, first, inputs, 0, False)
    plans[0].launch(("job",), time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
    assert kind.captures == 1
    # The buffers changed (the daemon keys plans by them): a new plan, captured anew; the
    # first plan's program still names only its own buffers.
    _load(kind, C.ALLREDUCE, second, inputs, 0, False)
    before = [kind.read(out).tobytes() for _, out in first]
    plans[1].launch(("job",), time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
    assert kind.captures == 2
    want = reference(C.ALLREDUCE, ReduceOp.SUM, inputs, 0, COUNT)
    for r, ((_, out), w) in enumerate(zip(second, want, strict=True)):
        assert_matches(kind.read(out), w, f"rank {r}")
    assert [kind.read(out).tobytes() for _, out in first] == before
    for plan in plans:
        plan.close()


class _WaitsOutside(DeviceGroup):
    """A plan whose first operation waits on an event recorded before the launch: CUDA
    refuses that inside a capture (the capture is invalidated)."""


def test_device_speed_captured_failure_falls_back_to_issuing(context, caplog) -> None:
    kind, keep = context.kind, []
    rng = np.random.default_rng(13)
    schedule = generate(C.ALLREDUCE, "ring", 2, COUNT, 0, 2)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 2)
    inputs = make_inputs(C.ALLREDUCE, 2, COUNT, np.dtype(np.float32), ReduceOp.SUM, rng, 0)
    pairs = _buffers(kind, C.ALLREDUCE, inputs, 0, False, keep)
    plan: StreamPlan = _WaitsOutside(context, schedule, pairs, reduction)
    elsewhere = kind.stream(0)
    outside = kind.event(0)
    kind.record(outside, elsewhere)  # an eager record, outside any capture
    plan.ops.insert(0, (kind.wait, (plan.all_streams()[0], outside)))
    with caplog.at_level(logging.WARNING, logger="lpsync.engine.device"):
        for _ in range(2):
            _load(kind, C.ALLREDUCE, pairs, inputs, 0, False)
            plan.launch(("job",), time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
            want = reference(C.ALLREDUCE, ReduceOp.SUM, inputs, 0, COUNT)
            for r, ((_, out), w) in enumerate(zip(pairs, want, strict=True)):
                assert_matches(kind.read(out), w, f"rank {r}")
    assert (kind.captures, kind.graph_launches) == (0, 0)  # issued both times
    warned = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == 1 and "outside" in warned[0], warned  # said once, with CUDA's reason
    plan.close()
    kind.destroy_stream(elsewhere)


def test_device_speed_captured_emulated_capture_refuses_what_cuda_refuses() -> None:
    """The emulated capture is strict where CUDA is: a stream that joined and did not
    rejoin the origin, a wait on an event recorded outside the capture (a client's
    interprocess event included) and a host wait on an event recorded in it each end the
    capture with an error; nothing given to the capture ran."""
    from lpsync_client import emulated as client_emulated

    kind = EmulatedKind(2)
    try:
        origin, other = kind.stream(0), kind.stream(1)
        memory = kind.allocate(0, 8)
        span = Span(memory, 0, 2, np.dtype(np.float32))
        kind.write(span, np.zeros(2, np.float32))

        def unjoined() -> None:
            fork = kind.event(0)
            kind.record(fork, origin)
            kind.wait(other, fork)  # joins
            kind.copy_async(span, span, other)  # and never comes back

        client = client_emulated.IpcEvent()
        client.record(client_emulated.Stream(0))
        opened = kind.open_event(client.handle, 0)
        outside = kind.event(1)
        kind.record(outside, other)  # an eager record, before the capture

        def host_wait() -> None:
            inside = kind.event(0)
            kind.record(inside, origin)
            kind.synchronize(inside, time.monotonic() + 5)

        cases = {
            "did not rejoin": unjoined,
            "recorded outside": lambda: kind.wait(origin, outside),
            "outside it": lambda: kind.wait(origin, opened),  # a client's interprocess event
            "host wait": host_wait,
        }
        for name, body in cases.items():
            kind.begin_capture(origin)
            ran: list[int] = []
            origin.put(lambda ran=ran: ran.append(1))
            with contextlib.suppress(Exception):  # CUDA returns it at the call too
                body()
            with pytest.raises(Exception, match=f"stream capture failed: .*{name}"):
                kind.end_capture(origin)
            assert origin.capture is None and other.capture is None, name
            done = kind.event(0)
            kind.record(done, origin)
            kind.synchronize(done, time.monotonic() + 5)
            assert ran == [], f"{name}: a captured operation ran"
        assert kind.captures == 0
    finally:
        kind.close_kind()


def test_device_speed_captured_replay_orders_lanes_by_the_captured_edges() -> None:
    """A replayed program runs its lanes concurrently, ordered only by its record -> wait
    edges: a copy that waits on another lane's slow write sees it, every replay."""
    kind = EmulatedKind(2)
    try:
        origin, other = kind.stream(0), kind.stream(0)
        a, b = kind.allocate(0, 4), kind.allocate(0, 4)
        sa, sb = Span(a, 0, 1, np.dtype(np.float32)), Span(b, 0, 1, np.dtype(np.float32))
        value = [0.0]

        def slow_write() -> None:
            time.sleep(0.05)
            a.array[:] = np.array([value[0]], np.float32).view(np.uint8)

        fork, written, join = kind.event(0), kind.event(0), kind.event(0)
        kind.begin_capture(origin)
        kind.record(fork, origin)
        kind.wait(other, fork)
        other.put(slow_write)  # lane 2: the slow write, then a record
        kind.record(written, other)
        kind.wait(origin, written)  # lane 1 waits for it, then copies
        kind.copy_async(sb, sa, origin)
        kind.record(join, other)
        kind.wait(origin, join)
        graph = kind.end_capture(origin)
        done = kind.event(0)
        for n in range(1, 4):
            value[0] = float(n)
            kind.launch_graph(graph, origin)
            kind.record(done, origin)
            kind.synchronize(done, time.monotonic() + 5)
            assert kind.read(sb).tolist() == [float(n)]
        assert (kind.captures, kind.graph_launches) == (1, 3)
    finally:
        kind.close_kind()
