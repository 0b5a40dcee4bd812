"""A blocking call answered on its own thread (TriggerStream.send_unlisted and reply_to,
Client._answer_now) against a scripted daemon on a real SEQPACKET socket: the replies of
other requests that come first complete their Futures; a reply that never comes ends the
wait at its deadline (the socket's own timeout is the kernel's, SO_RCVTIMEO, so a silent
daemon cannot hold the reader); a socket that ends, or the daemon's reason for closing it,
is raised to the waiter and fails every other request too."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lpsync_client._trigger import TriggerStream
from lpsync_client.errors import ResourceExhaustedError, UnavailableError
from lpsync_client.wire.proto import lpsync_pb2 as pb


class ScriptedDaemon:
    """The daemon's end of one trigger connection: answers the open, then does what the
    test says."""

    def __init__(self, where: Path) -> None:
        self.path = str(where / "fake.sock.trigger")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self.conn: socket.socket | None = None
        self._accepted = threading.Thread(target=self._accept, daemon=True)
        self._accepted.start()

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        conn.settimeout(10)
        first = pb.SessionRequest.FromString(conn.recv(1 << 16))
        conn.send(pb.SessionResponse(request_id=first.request_id, opened=first.open).SerializeToString())
        self.conn = conn

    def connected(self) -> socket.socket:
        self._accepted.join(10)
        assert self.conn is not None
        return self.conn

    def read(self) -> pb.SessionRequest:
        return pb.SessionRequest.FromString(self.connected().recv(1 << 16))

    def answer(self, request_id: int, code: str = "OK") -> None:
        reply = pb.SessionResponse(request_id=request_id, result=pb.CollectiveResult(code=code))
        self.connected().send(reply.SerializeToString())

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._listener.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ScriptedDaemon]:
    d = ScriptedDaemon(tmp_path)
    yield d
    d.close()


@pytest.fixture
def stream(daemon: ScriptedDaemon) -> Iterator[TriggerStream]:
    s = TriggerStream(daemon.path, "a-session", 5.0)
    yield s
    s.close()
    assert not any(t.name == "lpsync-client-trigger" and t.is_alive() for t in threading.enumerate())


@contextlib.contextmanager
def _reading(stream: TriggerStream) -> Iterator[None]:
    """This thread reads the replies for the block (as Client._answer_now does)."""
    assert stream.read_alone()
    try:
        yield
    finally:
        stream.stop_reading()


def _request(sequence: int) -> pb.SessionRequest:
    return pb.SessionRequest(collective=pb.CollectiveRequest(op="barrier", sequence=sequence))


def test_replies_of_other_requests_complete_their_futures_on_the_way(
    daemon: ScriptedDaemon, stream: TriggerStream
) -> None:
    with _reading(stream):
        other = stream.submit(_request(1), lambda r: ("other", r.request_id))  # async
        mine = stream.send_unlisted(_request(2))
        assert [daemon.read().collective.sequence for _ in range(2)] == [1, 2]
        daemon.answer(mine - 1)  # the other's reply comes first
        daemon.answer(mine)
        reply = stream.reply_to(mine, 5.0)
    assert reply is not None and reply.request_id == mine
    assert other.result(5) == ("other", mine - 1)


def test_a_reply_that_never_comes_ends_the_wait_at_its_deadline(
    daemon: ScriptedDaemon, stream: TriggerStream
) -> None:
    with _reading(stream):
        mine = stream.send_unlisted(_request(1))
        start = time.monotonic()
        assert stream.reply_to(mine, 0.2) is None
        waited = time.monotonic() - start
    assert 0.2 <= waited < 3.0, waited  # the socket's 1 s timeout, then the deadline
    # Its reply, late, is dropped; the next request is answered as usual.
    daemon.read()
    later = stream.submit(_request(2), lambda r: r.request_id)
    assert daemon.read().collective.sequence == 2
    daemon.answer(mine)
    daemon.answer(mine + 1)
    assert later.result(5) == mine + 1


def test_a_socket_that_ends_fails_the_wait_and_every_request(
    daemon: ScriptedDaemon, stream: TriggerStream
) -> None:
    with _reading(stream):
        other = stream.submit(_request(1), lambda r: r)
        mine = stream.send_unlisted(_request(2))
        daemon.read()
        daemon.read()
        daemon.connected().close()
        with pytest.raises(UnavailableError, match="closed"):
            stream.reply_to(mine, 5.0)
    assert isinstance(other.exception(5), UnavailableError)
    with pytest.raises(UnavailableError):
        stream.send_unlisted(_request(3))


def test_the_daemons_reason_for_closing_is_raised_to_the_waiter(
    daemon: ScriptedDaemon, stream: TriggerStream
) -> None:
    with _reading(stream):
        mine = stream.send_unlisted(_request(1))
        daemon.read()
        daemon.answer(0, code="RESOURCE_EXHAUSTED")  # request id 0: why it closes
        with pytest.raises(ResourceExhaustedError):
            stream.reply_to(mine, 5.0)


def test_only_one_thread_reads_at_a_time(stream: TriggerStream) -> None:
    with _reading(stream):
        elsewhere: list[bool] = []
        thread = threading.Thread(target=lambda: elsewhere.append(stream.read_alone()))
        thread.start()
        thread.join(5)
        assert elsewhere == [False]  # never waits: that caller takes the table's path
