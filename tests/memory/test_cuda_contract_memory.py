"""The emulated device as strict as CUDA where CUDA is unforgiving (docs/gpu.md, second
reading), and the memory-side fixes that strictness asks for: frees and event destruction
off the caller's thread with the device current, waits that fail on an error status.

Each strictness test first provokes the fault for real and checks that it is an error (or
a recorded fault), then that the fixed path does not commit it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError, UnavailableError
from lpsync.memory.emulated import EmulatedKind, current_device
from lpsync.memory.kind import Releaser, Span
from lpsync_client import emulated as client


def _in_thread(work):
    """``work()`` on a fresh thread (one with no device current); its result or error."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return box


def test_cuda_contract_a_destroyed_event_is_an_error_to_use():
    kind = EmulatedKind(1)
    try:
        stream, event = kind.stream(0), kind.event(0)
        kind.record(event, stream)
        kind.synchronize(event, time.monotonic() + 5)
        kind.destroy_event(event)
        for use in (
            lambda: kind.record(event, stream),
            lambda: kind.wait(stream, event),
            lambda: kind.synchronize(event, time.monotonic() + 5),
            lambda: kind.wait_ready(event, time.monotonic() + 5),
            lambda: kind.destroy_event(event),
        ):
            with pytest.raises(InvalidArgumentError, match="destroyed"):
                use()
        assert kind.releaser.flush(5)
        assert kind.destroyed_events == 1 and kind.faults == []
    finally:
        kind.close_kind()


def test_cuda_contract_a_closed_client_event_is_never_queried_again():
    kind = EmulatedKind(1)
    try:
        ready = client.IpcEvent()
        stream = client.Stream(0)
        ready.record(stream)
        stream.synchronize(5)  # its record completed: a query would say "done"
        opened = kind.open_event(ready.handle, 0)
        kind.wait_ready(opened, time.monotonic() + 5)  # open: fine
        kind.close_event(opened)
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="closed"):
            kind.wait_ready(opened, time.monotonic() + 5)
        assert time.monotonic() - started < 1.0
    finally:
        kind.close_kind()


def test_cuda_contract_a_sticky_error_fails_waits_at_once_not_at_their_deadline():
    kind = EmulatedKind(2)
    try:
        stream, event = kind.stream(0), kind.event(0)
        kind.record(event, stream)
        kind.synchronize(event, time.monotonic() + 5)
        pending = client.IpcEvent()
        # A record that cannot complete: its stream is blocked until the test ends.
        blocker = threading.Event()
        stalled = client.Stream(0)
        stalled.enqueue(lambda: blocker.wait(30))
        pending.record(stalled)
        opened = kind.open_event(pending.handle, 0)
        # Without the error the wait runs to its deadline: "not ready" is no failure.
        with pytest.raises(CollectiveTimeoutError):
            kind.wait_ready(opened, time.monotonic() + 0.3)
        kind.fail_device(0)
        for wait in (
            lambda: kind.synchronize(event, time.monotonic() + 30),
            lambda: kind.wait_ready(opened, time.monotonic() + 30),
            lambda: kind.wait_ready(event, time.monotonic() + 30),
        ):
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="sticky"):
                wait()
            assert time.monotonic() - started < 2.0
        other, other_stream = kind.event(1), kind.stream(1)  # another device is unaffected
        kind.record(other, other_stream)
        kind.synchronize(other, time.monotonic() + 5)
        blocker.set()
        kind.close_event(opened)
    finally:
        kind.close_kind()


def test_cuda_contract_a_thread_without_a_current_device_cannot_post_device_memory():
    kind = EmulatedKind(2)
    try:
        memory = kind.allocate(1, 64)
        wire = kind.wire(Span(memory, 0, 64, np.dtype(np.uint8)))
        unbound = _in_thread(wire.lpsync_post)
        assert isinstance(unbound.get("error"), UnavailableError), unbound
        assert "no device current" in str(unbound["error"])
        assert memory.posted == 0

        def bound() -> int | None:
            wire.lpsync_bind()
            end = wire.lpsync_post()
            posted = memory.posted
            end()
            end()  # once only
            return posted, current_device()

        result = _in_thread(bound)
        assert result.get("result") == (1, 1), result
        assert memory.posted == 0 and kind.faults == []
        assert kind.wire(Span(kind.allocate_host(8, 1), 0, 8, np.dtype(np.uint8))).__class__ is np.ndarray
    finally:
        kind.close_kind()


def test_cuda_contract_a_free_while_a_transfer_is_posted_is_detected_and_kept():
    kind = EmulatedKind(1)
    try:
        memory = kind.allocate(0, 4096)
        span = Span(memory, 0, 4096, np.dtype(np.uint8))
        kind.bind_thread(0)
        end = kind.wire(span).lpsync_post()
        kind.free(memory)  # UCX could still write here: a fault
        assert len(kind.faults) == 1 and "posted" in kind.faults[0]
        assert kind.releaser.flush(5)
        assert memory.array.nbytes == 4096  # kept, not unmapped under the transfer
        with pytest.raises(UnavailableError, match="freed"):
            kind.wire(span).lpsync_post()  # nothing new may be posted on it
        end()  # the transfer ended: now it goes
        assert kind.releaser.flush(5)
        assert memory.array.nbytes == 0
        clean = kind.allocate(0, 64)
        kind.wire(Span(clean, 0, 64, np.dtype(np.uint8))).lpsync_post()()
        kind.free(clean)
        assert kind.releaser.flush(5)
        assert kind.faults[1:] == ["a transfer posted on freed memory of device 0"]  # nothing more
    finally:
        kind.close_kind()


def test_cuda_contract_frees_leave_the_event_loop_at_once_and_run_with_their_device():
    kind = EmulatedKind(2)
    try:
        memories = [kind.allocate(1, 1 << 16) for _ in range(4)]
        stalled = threading.Event()
        kind.releaser.put(1, lambda: stalled.wait(10))  # the Releaser is busy (a slow cudaFree)

        async def on_the_loop() -> float:
            started = time.monotonic()
            for memory in memories:
                kind.free(memory)
            return time.monotonic() - started

        took = asyncio.run(on_the_loop())
        assert took < 0.5, took  # the loop did not wait for the busy Releaser
        assert all(m.array.nbytes for m in memories)  # not freed yet
        stalled.set()
        assert kind.releaser.flush(5)
        assert all(m.array.nbytes == 0 for m in memories)
        assert kind.contexts == [0, 1]  # device 1's context only: no free made device 0's
        assert kind.faults == []
    finally:
        kind.close_kind()


def test_cuda_contract_an_event_dropped_anywhere_is_destroyed_on_the_releaser_with_its_device():
    kind = EmulatedKind(2)
    real = kind.releaser
    try:

        def make_and_drop() -> None:
            event = kind.event(1)
            del event  # dropped on a thread with no device current (the event loop's case)

        # A destroy where its device is not current is what CUDA punishes: a releaser
        # that forgets to make it current is caught.
        kind.releaser = Releaser("careless", lambda device: None)
        assert "error" not in _in_thread(make_and_drop)
        assert kind.releaser.flush(5)
        assert kind.faults == ["an event of device 1 destroyed with device None current"]
        kind.releaser.stop()
        kind.faults.clear()
        kind.releaser = real
        assert "error" not in _in_thread(make_and_drop)
        assert kind.releaser.flush(5)
        assert kind.faults == [] and kind.destroyed_events == 2
        assert kind.contexts[0] == 0
    finally:
        kind.close_kind()


def test_cuda_contract_ucx_is_never_handed_memory_opened_through_ipc():
    """Second reading, point 7: the direct path handed UCX the client's own buffer (an IPC
    mapping); UCX's registration cache is not told of cudaIpcCloseMemHandle, so a later
    mapping at that address could be sent through a stale registration. The emulated
    device refuses to post such memory (the daemon's own posts as before)."""
    from lpsync_client.wire import split_device_uuid

    kind = EmulatedKind(1)
    allocation = client.Allocation(4096, 0)
    try:
        opened = kind.open(split_device_uuid(allocation.ipc_handle())[0], 0)
        kind.bind_thread(0)
        with pytest.raises(UnavailableError, match="opened through IPC"):
            kind.wire(Span(opened, 0, 4096, np.dtype(np.uint8))).lpsync_post()
        own = kind.allocate(0, 4096)
        kind.wire(Span(own, 0, 4096, np.dtype(np.uint8))).lpsync_post()()
        kind.close(opened)
        kind.free(own)
        assert kind.releaser.flush(5) and not kind.faults
    finally:
        allocation.free()
        kind.close_kind()
