"""The table of requests in flight and its Futures (lpsync_client._pending), without a
daemon: a Call is a real Future (concurrent.futures.wait, callbacks), its light wait
opens once it is done however it ends, and cancelling it runs on_cancel once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, wait

import pytest

from lpsync_client._pending import Call, Latch, PendingRequests
from lpsync_client.errors import UnavailableError
from lpsync_client.wire.proto import lpsync_pb2 as pb


def _submitted(table: PendingRequests, hook=lambda r: r.result.code) -> tuple[Call, list]:
    sent: list = []
    return table.submit(pb.SessionRequest(), hook, sent.append), sent


def test_a_call_settles_when_its_response_comes_from_another_thread() -> None:
    table = PendingRequests("test")
    call, sent = _submitted(table)
    assert sent[0].request_id == 1 and not call.settled(0.05)
    seen: list = []
    call.add_done_callback(lambda f: seen.append(f.result()))
    response = pb.SessionResponse(request_id=1, result=pb.CollectiveResult(code="OK"))
    threading.Timer(0.1, table.complete, (response,)).start()
    began = time.monotonic()
    assert call.settled(10.0)
    assert time.monotonic() - began < 5.0
    assert call.result(0) == "OK" and seen == ["OK"]
    assert wait([call], 0).done == {call}  # still a Future to concurrent.futures
    assert call.settled(0)  # open for every later waiter


def test_a_failed_transport_settles_every_call_with_its_error() -> None:
    table = PendingRequests("test")
    calls = [_submitted(table)[0] for _ in range(3)]
    table.fail_all(UnavailableError("gone"))
    for call in calls:
        assert call.settled(0)
        with pytest.raises(UnavailableError, match="gone"):
            call.result(0)
    with pytest.raises(UnavailableError):
        _submitted(table)


def test_a_hook_that_raises_settles_the_call_with_its_error() -> None:
    def hook(response):
        raise ValueError("bad reply")

    table = PendingRequests("test")
    call, _ = _submitted(table, hook)
    table.complete(pb.SessionResponse(request_id=1))
    assert call.settled(0)
    with pytest.raises(ValueError, match="bad reply"):
        call.result(0)


def test_cancelling_runs_on_cancel_once_and_drops_the_late_response() -> None:
    table = PendingRequests("test")
    call, _ = _submitted(table)
    told: list = []
    call.on_cancel = lambda: told.append("cancel")
    assert call.cancel() and call.cancel()  # a second cancel of a cancelled Future: True
    assert told == ["cancel"] and call.settled(0)
    table.complete(pb.SessionResponse(request_id=1, result=pb.CollectiveResult(code="OK")))
    with pytest.raises(CancelledError):
        call.result(0)


def test_a_finished_call_cannot_be_cancelled() -> None:
    table = PendingRequests("test")
    call, _ = _submitted(table)
    call.on_cancel = lambda: pytest.fail("on_cancel ran for a finished call")
    table.complete(pb.SessionResponse(request_id=1, result=pb.CollectiveResult(code="OK")))
    assert not call.cancel() and call.result(0) == "OK"


def test_a_latch_opens_once_for_every_waiter() -> None:
    """Latch (works' and Calls' done signal): closed until set, then open for every waiter
    at once and every later one; a second set is harmless; a wait times out while closed."""
    latch = Latch()
    assert not latch.is_set() and not latch.wait(0.05)
    woken: list[float] = []
    waiters = [
        threading.Thread(target=lambda: latch.wait(10) and woken.append(time.monotonic())) for _ in range(4)
    ]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.1)
    assert not woken
    opened = time.monotonic()
    latch.set()
    for waiter in waiters:
        waiter.join(10)
    assert len(woken) == 4 and all(at - opened < 5 for at in woken)
    latch.set()
    assert latch.is_set() and latch.wait(0) and latch.wait()
