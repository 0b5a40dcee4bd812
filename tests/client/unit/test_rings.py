"""The asynchronous rings' order (lpsync_client/_rings.py): a ring queued behind a general
request still in flight is rung only once that request is answered, and the rings after
it follow in order; a ring with nothing ahead of it is rung at once."""

from __future__ import annotations

import threading

from lpsync_client import doorbell
from lpsync_client._pending import Call, Latch
from lpsync_client._rings import Ring, Rings


class _Page:
    """A doorbell page that answers OK to every ring once it is posted."""

    def __init__(self) -> None:
        self.posted: list[int] = []
        self._changed = threading.Condition()

    def post(self, seq: int, plan: int, generation: int) -> None:
        with self._changed:
            self.posted.append(seq)
            self._changed.notify_all()

    def answer(self, seq: int, timeout: float, gone) -> int:
        with self._changed:
            assert self._changed.wait_for(lambda: seq in self.posted, timeout)
        return doorbell.OK


def _ring(page: _Page, seq: int, after: Latch | None) -> Ring:
    def general() -> Call:
        raise AssertionError("an OK ring never goes the general way")

    return Ring(page, 1, 1, seq, f"result {seq}", general, 10.0, Call(), after)  # type: ignore[arg-type]


def test_a_ring_behind_a_general_request_waits_for_its_answer() -> None:
    page, rings, sent = _Page(), Rings(lambda: False), Latch()
    try:
        first = rings.submit(_ring(page, 7, sent))
        second = rings.submit(_ring(page, 8, None))
        assert not first.settled(0.3)  # the general request #6 is not answered yet
        assert page.posted == []
        sent.set()  # its reply came
        assert first.settled(5.0) and second.settled(5.0)
        assert page.posted == [7, 8]
        assert (first.result(), second.result()) == ("result 7", "result 8")
    finally:
        rings.close()


def test_a_ring_with_nothing_ahead_is_rung_at_once() -> None:
    page, rings, answered = _Page(), Rings(lambda: False), Latch()
    answered.set()
    try:
        call = rings.submit(_ring(page, 3, answered))
        assert page.posted == [3]  # by the caller, before any thread ran
        assert call.settled(5.0) and call.result() == "result 3"
    finally:
        rings.close()
