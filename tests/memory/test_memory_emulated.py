"""The emulated device honours kind.py's contract: streams in order, CUDA's event rules,
IPC handles that open in another process, sticky errors, deadlines, no leaked threads."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from lpsync.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from lpsync.memory.devices import parse_devices
from lpsync.memory.emulated import HANDLE, MAGIC, EmulatedKind
from lpsync.memory.kind import Span
from lpsync.reduction import Reduction
from lpsync.types import ReduceOp
from lpsync_client import emulated as client_emulated
from lpsync_client.wire import split_device_uuid


@pytest.fixture
def kind():
    k = EmulatedKind(2, parse_devices("emulated:2").topology, copy_bandwidth=0)
    yield k
    k.close_kind()


def _span(memory, dtype=np.float32) -> Span:
    return Span(memory, 0, memory.nbytes // np.dtype(dtype).itemsize, np.dtype(dtype))


def test_stream_runs_in_order_and_events_order_streams(kind):
    slow = EmulatedKind(2, copy_bandwidth=4e6)  # 4 MB/s: a 400 kB copy takes ~0.1 s
    try:
        a, b, c = (slow.allocate(d, 400_000) for d in (0, 0, 1))
        a.array[:] = 7
        s0, s1 = slow.stream(0), slow.stream(1)
        done = slow.event(0)
        slow.copy_async(_span(b), _span(a), s0)  # slow
        slow.record(done, s0)
        slow.wait(s1, done)
        slow.copy_async(_span(c)[:4], _span(b)[:4], s1)  # fast; must see b's new contents
        end = slow.event(1)
        slow.record(end, s1)
        slow.synchronize(end, time.monotonic() + 10)
        assert (c.array[:16] == 7).all()
    finally:
        slow.close_kind()


def test_a_wait_enqueued_before_its_record_is_a_no_op(kind):
    """As cudaStreamWaitEvent: only records enqueued before the wait count."""
    event, stream = kind.event(0), kind.stream(0)
    kind.wait(stream, event)  # never recorded: ignored, the stream does not block
    marker = kind.event(0)
    kind.record(marker, stream)
    kind.synchronize(marker, time.monotonic() + 5)


def test_synchronize_has_a_deadline(kind):
    blocker = threading.Event()
    stream = kind.stream(0)
    stream.put(lambda: blocker.wait(10))
    event = kind.event(0)
    kind.record(event, stream)
    with pytest.raises(CollectiveTimeoutError):
        kind.synchronize(event, time.monotonic() + 0.2)
    blocker.set()
    kind.synchronize(event, time.monotonic() + 5)


def test_a_failed_operation_poisons_the_stream(kind):
    stream = kind.stream(1)
    mem = kind.allocate(1, 64)
    ran = []
    stream.put(lambda: 1 / 0)
    stream.put(lambda: ran.append(1))  # skipped: the stream is poisoned
    event = kind.event(1)
    kind.record(event, stream)
    with pytest.raises(UnavailableError, match="ZeroDivision"):
        kind.synchronize(event, time.monotonic() + 5)
    assert not ran
    again = kind.event(1)
    kind.record(again, stream)
    with pytest.raises(UnavailableError):  # sticky until recovered
        kind.synchronize(again, time.monotonic() + 5)
    kind.recover(stream)
    stream.put(lambda: ran.append(2))
    kind.record(again, stream)
    kind.synchronize(again, time.monotonic() + 5)
    assert ran == [2]
    kind.free(mem)


def test_reduce_and_reach_rules(kind):
    a, b = kind.allocate(0, 40), kind.allocate(0, 40)
    a.array.view(np.float32)[:] = 2
    b.array.view(np.float32)[:] = 3
    stream = kind.stream(0)
    kind.reduce_async(
        Reduction(ReduceOp.AVG, np.dtype(np.float32), 2), _span(a), _span(a), _span(b), True, stream
    )
    event = kind.event(0)
    kind.record(event, stream)
    kind.synchronize(event, time.monotonic() + 5)
    assert a.array.view(np.float32).tolist() == [2.5] * 10
    other = kind.allocate(1, 40)
    with pytest.raises(InvalidArgumentError, match="own device"):
        kind.reduce_async(
            Reduction(ReduceOp.SUM, np.dtype(np.float32), 2), _span(a), _span(a), _span(other), False, stream
        )
    host_only = EmulatedKind(2, parse_devices("emulated:2,host=0-1").topology)
    try:
        with pytest.raises(InvalidArgumentError, match="no peer access"):
            host_only.copy_async(_span(a), _span(other), host_only.stream(0))
    finally:
        host_only.close_kind()


def _export_and_wait(conn) -> None:
    alloc = client_emulated.Allocation(4096, device=1)
    alloc.bytes[:] = np.arange(4096) % 251
    handle, _ = split_device_uuid(alloc.ipc_handle())  # the registry takes the UUID off
    conn.send(handle)
    conn.recv()  # until told to exit


def test_ipc_handles_open_in_another_process_while_the_exporter_lives(kind):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export_and_wait, args=(child,))
    proc.start()
    try:
        handle = parent.recv()
        with pytest.raises(InvalidArgumentError, match="device 1, not 0"):
            kind.open(handle, 0)
        opened = kind.open(handle, 1)
        assert opened.array.tolist() == (np.arange(4096) % 251).tolist()
        assert (kind.opens, kind.closes) == ([0, 1], [0, 0])
        parent.send("exit")
        proc.join(10)
        # The exporter is gone: a new open fails, the open mapping stays valid.
        with pytest.raises(NotFoundError):
            kind.open(handle, 1)
        assert opened.array[:5].tolist() == [0, 1, 2, 3, 4]
        kind.close(opened)
        kind.close(opened)  # idempotent: counted once
        assert kind.closes == [0, 1]
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_streams_end_with_the_kind():
    before = threading.active_count()
    k = EmulatedKind(3)
    for d in range(3):
        k.stream(d)
    assert threading.active_count() == before + 3
    k.close_kind()
    assert threading.active_count() == before


def test_a_handle_cannot_name_an_ordinary_file(kind, tmp_path):
    """The daemon maps and writes what a handle names: only emulated device memory."""
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 4096)
    fd = os.open(victim, os.O_RDWR)
    try:
        handle = HANDLE.pack(MAGIC, os.getpid(), fd, os.fstat(fd).st_ino, 4096, 0)
        with pytest.raises(InvalidArgumentError, match="emulated device memory"):
            kind.open(handle, 0)
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"x" * 4096


def _event_exporter(conn) -> None:
    """Another process: an interprocess event recorded on a stream held by a gate."""
    from lpsync_client import emulated as ce

    event, stream, gate = ce.IpcEvent(), ce.Stream(0), threading.Event()
    stream.enqueue(lambda: gate.wait(30))
    event.record(stream)  # completes once the gate opens
    conn.send(event.handle)
    conn.recv()
    gate.set()
    stream.synchronize(10)
    event.record(stream)  # completes at once: a record the daemon's wait came before
    conn.send("recorded again")
    conn.recv()


def test_an_interprocess_event_orders_the_daemon_stream_after_the_client_stream(kind):
    """cudaIpcOpenEventHandle + cudaStreamWaitEvent's stand-in: the daemon's stream waits
    (asleep in a futex) for the client's latest record made before the wait;
    closing the event (the client's session ended) releases a stream still waiting."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_event_exporter, args=(child,))
    proc.start()
    try:
        handle = parent.recv()
        event = kind.open_event(handle, 0)
        stream, after = kind.stream(0), kind.event(0)
        ran = threading.Event()
        kind.wait(stream, event)
        stream.put(ran.set)
        kind.record(after, stream)
        time.sleep(0.3)
        assert not ran.is_set(), "the stream did not wait for the client's record"
        parent.send("open the gate")
        kind.synchronize(after, time.monotonic() + 10)
        assert ran.is_set()
        assert parent.recv() == "recorded again"
        kind.wait(stream, event)  # generation 2, completed already: no wait
        kind.record(after, stream)
        kind.synchronize(after, time.monotonic() + 10)
        # A wait on a record that never completes is released by close_event, with an error.
        fake = client_emulated.IpcEvent()
        stuck = kind.open_event(fake.handle, 1)
        fake._words[0] = 5  # a record "made" whose completion never comes
        s1, done = kind.stream(1), kind.event(1)
        kind.wait(s1, stuck)
        kind.record(done, s1)
        with pytest.raises(CollectiveTimeoutError):
            kind.synchronize(done, time.monotonic() + 0.3)
        kind.close_event(stuck)
        with pytest.raises(UnavailableError, match="client's event was closed"):
            kind.synchronize(done, time.monotonic() + 5)
        parent.send("exit")
        proc.join(10)
        with pytest.raises(NotFoundError):  # the exporter is gone
            kind.open_event(handle, 0)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_event_handles_are_checked(kind, tmp_path):
    import os

    with pytest.raises(InvalidArgumentError, match="event handle"):
        kind.open_event(b"short", 0)
    with pytest.raises(InvalidArgumentError, match="bad magic"):
        kind.open_event(HANDLE.pack(MAGIC, 1, 2, 3, 4, 0)[:20], 0)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 8)
    fd = os.open(victim, os.O_RDWR)
    try:
        from lpsync.memory.emulated import EVENT_HANDLE, EVENT_MAGIC

        with pytest.raises(InvalidArgumentError, match="does not name"):
            kind.open_event(EVENT_HANDLE.pack(EVENT_MAGIC, os.getpid(), fd, os.fstat(fd).st_ino), 0)
    finally:
        os.close(fd)
