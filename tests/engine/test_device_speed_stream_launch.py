"""Stream-ordered launches (issue 47, item 1) on the emulated device, in one process: a
launch is enqueued behind the clients' ready events and the job's previous launch, its
done events complete after its finals, an error found after the answer fails the job's
next collective (and still completes the done event: no client stream is left stuck),
and a plan closed under a launch keeps its memory until the streams finished."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext, DeviceGroup, Lanes
from lpsync.errors import UnavailableError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span, Topology
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp
from lpsync_client import emulated as client_emulated

OWNER = ("job",)


@pytest.fixture
def context():
    ctx = DeviceContext(EmulatedKind(2, Topology.uniform(2)))
    yield ctx
    ctx.close()
    ctx.kind.close_kind()


def _group(context: DeviceContext, count: int, keep: list) -> tuple[DeviceGroup, list[Span]]:
    kind, spans = context.kind, []
    for device in (0, 1):
        memory = kind.allocate(device, count * 4)
        keep.append(memory)
        spans.append(Span(memory, 0, count, np.dtype(np.float32)))
    schedule = generate(Collective.ALLREDUCE, "ring", 2, count, 0, 4)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 2)
    lanes = Lanes(context, OWNER)
    return DeviceGroup(context, schedule, [(s, s) for s in spans], reduction, lanes=lanes), spans


def _after_watcher(context: DeviceContext) -> None:
    """Until the job's watcher ran everything queued so far (it runs in order)."""
    flushed = threading.Event()
    context.completions.put(OWNER, flushed.set)
    assert flushed.wait(30)


def test_done_event_completes_after_the_work_and_orders_a_client_stream(context) -> None:
    keep: list = []
    kind = context.kind
    group, spans = _group(context, 4096, keep)
    client, gate = client_emulated.IpcEvent(), threading.Event()
    client_stream = client_emulated.Stream(0)
    client_stream.enqueue(lambda: gate.wait(30))  # the client's kernel, still running
    client.record(client_stream)
    ready = kind.open_event(client.handle, 0)
    values = [np.arange(4096, dtype=np.float32) * (r + 1) for r in range(2)]
    for span, x in zip(spans, values, strict=True):
        kind.write(span, x)
    done, handle = context.done_events.take("session", 0)
    launch = group.launch(OWNER, time.monotonic() + 30, [ready, None], [(0, done)])
    # Enqueued, not finished: the streams wait for the client's event.
    opened = client_emulated.OpenedEvent(handle)
    seen: list[np.ndarray] = []
    later = client_emulated.Stream(0)
    opened.wait(later)  # the client's stream, after the answer
    later.enqueue(lambda: seen.append(kind.read(spans[0])))
    time.sleep(0.2)
    assert seen == [] and not opened.reached(1)
    gate.set()
    later.synchronize(30)
    assert seen[0].tobytes() == (values[0] + values[1]).tobytes()
    launch.wait(time.monotonic() + 30)
    _after_watcher(context)
    context.done_events.give("session", 0, (done, handle))
    group.close()
    assert context.pool.outstanding == 0
    kind.close_event(ready)


def test_an_error_after_the_answer_fails_the_next_collective(context) -> None:
    keep: list = []
    kind = context.kind
    group, spans = _group(context, 1024, keep)
    client, gate = client_emulated.IpcEvent(), threading.Event()
    client_stream = client_emulated.Stream(1)
    client_stream.enqueue(lambda: gate.wait(30))  # a client that never gets there
    client.record(client_stream)
    ready = kind.open_event(client.handle, 1)
    done, handle = context.done_events.take("session", 0)
    launch = group.launch(OWNER, time.monotonic() + 30, [None, ready], [(0, done)])
    launch.answered()  # stream-ordered: the clients heard OK already
    opened = client_emulated.OpenedEvent(handle)
    waiting = client_emulated.Stream(0)
    opened.wait(waiting)
    kind.close_event(ready)  # the client's session ended: its event is closed
    waiting.synchronize(30)  # the done event still completed: no client stream stays stuck
    _after_watcher(context)
    failure = context.take_failure(OWNER)
    assert isinstance(failure, UnavailableError), failure
    assert context.take_failure(OWNER) is None  # reported once
    # The streams were drained and recovered: the job's next launch is right.
    values = [np.full(1024, 2.0, np.float32), np.full(1024, 3.0, np.float32)]
    for span, x in zip(spans, values, strict=True):
        kind.write(span, x)
    group.launch(OWNER, time.monotonic() + 30, [], []).wait(time.monotonic() + 30)
    for span in spans:
        assert kind.read(span).tobytes() == (values[0] + values[1]).tobytes()
    gate.set()
    context.done_events.give("session", 0, (done, handle))
    group.close()


def test_a_plan_closed_under_a_launch_keeps_its_memory_until_it_finished(context) -> None:
    keep: list = []
    kind = context.kind
    group, _ = _group(context, 2048, keep)
    client, gate = client_emulated.IpcEvent(), threading.Event()
    client_stream = client_emulated.Stream(0)
    client_stream.enqueue(lambda: gate.wait(30))
    client.record(client_stream)
    ready = kind.open_event(client.handle, 0)
    held = context.pool.outstanding
    assert held > 0  # the ring's staging buffers
    launch = group.launch(OWNER, time.monotonic() + 30, [ready, None], [])
    group.close()  # the job let go of the plan while its launch waits on the streams
    assert context.pool.outstanding == held
    gate.set()
    launch.wait(time.monotonic() + 30)
    _after_watcher(context)
    assert context.pool.outstanding == 0
    kind.close_event(ready)


def test_done_events_are_pooled_per_session_and_destroyed_with_it(context) -> None:
    kind = context.kind
    taken = [context.done_events.take("a", 0) for _ in range(3)]
    assert all(entry is not None for entry in taken)
    for entry in taken:
        context.done_events.give("a", 0, entry)
    again = context.done_events.take("a", 0)
    assert again is not None and context.done_events.made == 3  # reused, not made anew
    destroyed = kind.destroyed_events
    context.done_events.drop("a")  # two free ones now, the one out when it comes back
    assert context.done_events.take("a", 0) is None  # the session is gone
    assert kind.releaser.flush()
    assert kind.destroyed_events == destroyed + 2
    context.done_events.give("a", 0, again)
    assert kind.releaser.flush()
    assert kind.destroyed_events == destroyed + 3
    assert context.done_events.outstanding() == 0 and context.done_events.pooled() == 0
