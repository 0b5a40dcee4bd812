"""The any-source inbox (collectives/inbox.py) and the probe's checks (control/any_source.py):
matching order, spoken-for messages, late announcements, deadlines, bounds and bad
probes. (Through real daemons and clients: tests/daemon/test_point_to_point.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from lpsync.daemon.collectives import inbox
from lpsync.daemon.collectives.inbox import Inbox
from lpsync.daemon.control.any_source import AnySource
from lpsync.daemon.watcher import Watcher
from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError, LpsyncError, ResourceExhaustedError
from lpsync_client.wire.proto import lpsync_pb2 as pb

KEY = ("job", 0, 5)


class Answers:
    def __init__(self) -> None:
        self.got: list[tuple[int, int] | LpsyncError] = []
        self.event = threading.Event()

    def found(self, source: int, sequence: int) -> None:
        self.got.append((source, sequence))
        self.event.set()

    def failed(self, error: LpsyncError) -> None:
        self.got.append(error)
        self.event.set()


@pytest.fixture
def box():
    watcher = Watcher()
    yield Inbox(watcher, max_messages=4)
    watcher.stop()


def _probe(box: Inbox, issued: dict[int, int], seconds: float = 5.0) -> Answers:
    answers = Answers()
    box.probe(KEY, issued, time.monotonic() + seconds, answers.found, answers.failed)
    return answers


def test_the_oldest_message_beyond_the_issued_receives_is_named(box: Inbox) -> None:
    box.announce(KEY, 2, 1, 30.0)
    box.announce(KEY, 1, 1, 30.0)
    box.announce(KEY, 2, 2, 30.0)
    assert _probe(box, {}).got == [(2, 1)]
    # Rank 2's first message spoken for (a receive from it was issued): rank 1's is next.
    assert _probe(box, {2: 1}).got == [(1, 1)]
    assert _probe(box, {2: 1, 1: 1}).got == [(2, 2)]
    # Other tags and ranks have their own inboxes.
    other = Answers()
    box.probe(("job", 0, 6), {}, time.monotonic() + 0.2, other.found, other.failed)
    assert other.event.wait(5) and isinstance(other.got[0], CollectiveTimeoutError)


def test_a_probe_waits_for_the_announcement(box: Inbox) -> None:
    answers = _probe(box, {1: 3})
    box.announce(KEY, 1, 3, 30.0)  # spoken for: still waiting
    assert not answers.event.wait(0.2)
    threading.Timer(0.1, lambda: box.announce(KEY, 2, 1, 30.0)).start()
    assert answers.event.wait(5) and answers.got == [(2, 1)]


def test_waiting_probes_are_listed_by_job_until_answered(box: Inbox) -> None:
    answers = _probe(box, {})
    time.sleep(0.05)
    [(rank, tag, seconds)] = box.waiting("job")
    assert (rank, tag) == (0, 5) and seconds >= 0.05
    assert box.waiting("another job") == []
    box.announce(KEY, 1, 1, 30.0)
    assert answers.got == [(1, 1)] and box.waiting("job") == []


def test_finished_messages_leave_and_late_announcements_are_dropped(box: Inbox) -> None:
    box.announce(KEY, 1, 1, 30.0)
    box.finished(KEY, 1, 1)  # received by a named receive
    box.finished(KEY, 2, 4)
    box.announce(KEY, 2, 3, 30.0)  # crossed the peer plane slower than the data
    answers = _probe(box, {}, seconds=0.3)
    assert answers.event.wait(5)
    (error,) = answers.got
    assert isinstance(error, CollectiveTimeoutError) and "from any source" in str(error), error


def test_a_send_past_its_deadline_is_not_named(box: Inbox) -> None:
    box.announce(KEY, 1, 1, 0.05)
    time.sleep(0.1)
    box.announce(KEY, 2, 1, 30.0)
    assert _probe(box, {}).got == [(2, 1)]


def test_the_inbox_is_bounded(box: Inbox, caplog) -> None:
    for sequence in range(1, 7):
        box.announce(KEY, 1, sequence, 30.0)
    assert _probe(box, {}).got == [(1, 3)]  # the two oldest dropped (and logged)
    assert "full" in caplog.text
    waiting = [_probe(box, {1: 99}) for _ in range(4)]
    refused = _probe(box, {1: 99})
    assert isinstance(refused.got[0], ResourceExhaustedError), refused.got
    assert not any(w.got for w in waiting)


def test_notes_round_trip_and_bad_ones_are_refused() -> None:
    data = inbox.note(KEY, 3, 7, 12.5)
    assert inbox.read_note(data) == (KEY, 3, 7, 12.5)
    for bad in (b"", b"[1, 2]", b"{}", b'["j", 0, 5, "x", 1, 2]', b"\xff"):
        with pytest.raises(ValueError):
            inbox.read_note(bad)


@pytest.mark.parametrize(
    "probe, words",
    [
        (pb.Probe(tag=1 << 31), "tag"),
        (pb.Probe(tag=1, sources=[1], issued=[]), "sources"),
        (pb.Probe(tag=1, sources=[1, 2, 0, 1], issued=[1, 1, 1, 1]), "sources"),
        (pb.Probe(tag=1, sources=[9], issued=[1]), "beyond"),
    ],
)
def test_a_bad_probe_is_invalid_argument(probe: pb.Probe, words: str) -> None:
    watcher = Watcher()
    any_source = AnySource(watcher, None, 16)
    session = SimpleNamespace(job="job", rank=0, world_size=3)
    try:
        with pytest.raises(InvalidArgumentError, match=words):
            any_source.probe(session, 1.0, probe, lambda r: None, lambda e: None)  # type: ignore[arg-type]
    finally:
        watcher.stop()


def test_a_refused_send_leaves_the_inbox_on_one_node() -> None:
    watcher = Watcher()
    any_source = AnySource(watcher, None, 16)
    try:
        pair = SimpleNamespace(name="job/p2p/2>0/5", layout=None)
        arrival = SimpleNamespace(sequence=1, timeout=30.0)
        any_source.sent(pair, 0, arrival)  # type: ignore[arg-type]
        any_source.sent(pair, 1, arrival)  # the receiver's own arrival announces nothing
        assert any_source.inbox._match(KEY, {}) is not None
        any_source.refused(pair, 0, arrival)  # type: ignore[arg-type]
        assert any_source.inbox._match(KEY, {}) is None
        any_source.sent(SimpleNamespace(name="not-a-pair", layout=None), 0, arrival)  # type: ignore[arg-type]
        assert any_source.inbox._messages == {}
    finally:
        watcher.stop()


def test_the_bounds_hold_across_keys(box: Inbox, caplog) -> None:
    deadline = time.monotonic() + 5
    waiting = [Answers() for _ in range(5)]
    for tag, answers in enumerate(waiting):
        box.probe(("job", 0, 100 + tag), {}, deadline, answers.found, answers.failed)
    assert [type(a.got[0]) for a in waiting if a.got] == [ResourceExhaustedError]  # the fifth
    for tag in range(5):  # a send to each of five other tags: the fifth finds the inbox full
        box.announce(("job", 1, tag), 2, 1, 30.0)
    assert [t for t in range(5) if box._match(("job", 1, t), {})] == [0, 1, 2, 3]
    assert "full" in caplog.text
