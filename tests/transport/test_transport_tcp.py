"""What only the TCP backend has to get right, in process over loopback: messages that
arrive before their receive, per-tag order, sends larger than the socket buffers (the
writer thread), many threads sending at once, short messages into larger receives and a
message too large for its receive. The shared behaviour (real schedules, killed peers,
secrets, rebuilds) is in test_peer_transports.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import numpy as np
import pytest

from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError, UnavailableError
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.mesh import MeshOptions
from lpsync.transport.tcp import TcpEndpoint
from tests.ports import free_ports
from tests.transport.pairs import connected_pair, next_message_intact, threads

SECRET = b"tcp test secret"


def _threads() -> set[str]:
    return threads("lpsync-tcp")


def pair() -> AbstractContextManager[tuple[TcpEndpoint, TcpEndpoint]]:
    """Two connected endpoints in this process; afterwards no lpsync-tcp thread is left."""
    return connected_pair(TcpEndpoint.connect, SECRET, "lpsync-tcp")


def test_messages_sent_before_their_receive_arrive_whole_and_in_order() -> None:
    rng = np.random.default_rng(1)
    messages = [rng.integers(0, 255, size, dtype=np.uint8) for size in (0, 1, 7, 100_000, 3)]
    with pair() as (a, b):
        sends = [a.send(1, 42, m) for m in messages]  # same tag: order must hold
        deadline = time.monotonic() + 10
        for request in sends:
            request.wait(deadline)
        time.sleep(0.2)  # all of them now wait unexpected on b's side
        for m in messages:
            out = np.full(m.size, 0xEE, np.uint8)
            b.recv_into(0, 42, out, deadline)
            np.testing.assert_array_equal(out, m)


def test_large_messages_both_ways_at_once_go_through_the_writer_threads() -> None:
    """64 MiB each way, both sending before either receives: far beyond the socket
    buffers, so the sends queue for the writer threads while the readers drain."""
    rng = np.random.default_rng(2)
    big = [rng.integers(0, 255, 64 << 20, dtype=np.uint8) for _ in range(2)]
    with pair() as (a, b):
        deadline = time.monotonic() + 60
        outs = [np.empty(64 << 20, np.uint8) for _ in range(2)]
        sent = [a.send(1, 5, big[0]), b.send(0, 5, big[1])]
        assert not all(s.done() for s in sent)  # at least one waits for the writer thread
        posted = [b.post_recv(0, 5, outs[1]), a.post_recv(1, 5, outs[0])]
        for request in sent + posted:
            request.wait(deadline)
        np.testing.assert_array_equal(outs[1], big[0])
        np.testing.assert_array_equal(outs[0], big[1])


def test_many_threads_sending_on_one_connection_keep_frames_whole() -> None:
    with pair() as (a, b):
        deadline = time.monotonic() + 30

        def sender(t: int) -> None:
            for i in range(50):
                a.send(1, t * 1000 + i, np.full(1000 + t, t, np.int32)).wait(deadline)

        threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for t in range(4):
            for i in range(50):
                out = np.empty(1000 + t, np.int32)
                b.recv_into(0, t * 1000 + i, out, deadline)
                assert (out == t).all()
        for thread in threads:
            thread.join()


def test_a_shorter_message_lands_and_a_longer_one_is_refused_without_breaking() -> None:
    with pair() as (a, b):
        deadline = time.monotonic() + 10
        out = np.zeros(16, np.uint8)
        request = b.post_recv(0, 1, out)
        a.send(1, 1, np.arange(4, dtype=np.uint8)).wait(deadline)
        request.wait(deadline)
        assert out[:4].tolist() == [0, 1, 2, 3] and not out[4:].any()
        a.send(1, 2, np.arange(32, dtype=np.uint8)).wait(deadline)
        with pytest.raises(InvalidArgumentError, match="larger than the receive buffer"):
            b.recv_into(0, 2, np.zeros(8, np.uint8), deadline)  # it came first: kept
        early = b.post_recv(0, 4, np.zeros(8, np.uint8))  # posted first: read off the wire
        a.send(1, 4, np.arange(3 << 20, dtype=np.uint8)).wait(deadline)
        with pytest.raises(InvalidArgumentError, match="larger than the receive buffer"):
            early.wait(deadline)
        next_message_intact(a, b, deadline)  # the excess was read off the wire


def test_a_channel_calls_back_on_the_thread_that_finishes_each_request() -> None:
    """channel(): a posted receive's callback runs on the connection's reader as the
    message lands (or on the posting thread when it came first), a send's on the sending
    thread when the socket took it all and on the writer when it did not; a message too
    large for its receive calls back with the error, and the connection goes on."""
    rng = np.random.default_rng(7)
    with pair() as (a, b):
        deadline = time.monotonic() + 10
        into, out_of = b.channel(0), a.channel(1)
        seen: list[tuple[str, object, str]] = []
        done = threading.Event()

        def note(what: str, count: int):  # type: ignore[no-untyped-def]
            def then(request):  # type: ignore[no-untyped-def]
                seen.append((what, request.error, threading.current_thread().name))
                if len(seen) == count:
                    done.set()

            return then

        data = rng.integers(0, 255, 3 << 20, dtype=np.uint8)  # past the socket buffers
        out = np.zeros(data.size, np.uint8)
        into.post(10, out, note("received", 2))
        sent = out_of.send(10, data, note("sent", 2))
        assert done.wait(10), seen
        assert (out == data).all() and sent.done and sent.error is None
        threads = {what: thread for what, _, thread in seen}
        assert threads["received"] == "lpsync-tcp-r1-from-0", seen
        assert threads["sent"] in ("lpsync-tcp-r0-to-1", threading.current_thread().name), seen
        # The message first, then the receive: called back on the posting thread.
        seen.clear()
        done.clear()
        a.send(1, 20, data[:1000]).wait(deadline)
        time.sleep(0.2)  # it waits unexpected on b's side
        into.post(20, out[:1000], note("early", 1))
        assert seen == [("early", None, threading.current_thread().name)]
        # Too large: the callback has the error; the next message is intact.
        seen.clear()
        done.clear()
        into.post(30, np.zeros(8, np.uint8), note("too large", 1))
        a.send(1, 30, np.arange(64, dtype=np.uint8)).wait(deadline)
        assert done.wait(10)
        assert isinstance(seen[0][1], InvalidArgumentError), seen
        next_message_intact(a, b, deadline)


def test_a_header_announcing_more_than_memory_breaks_the_endpoint_cleanly() -> None:
    """A peer's bug, not a crash: the reader reports the peer gone instead of dying."""
    with pair() as (a, b):
        a._conns[1].sock.sendall(struct.pack("<QQ", 7, 1 << 62))
        time.sleep(0.5)  # read before any receive is posted: it cannot be kept
        with pytest.raises(UnavailableError, match="rank 0"):
            b.recv_into(0, 7, np.zeros(8, np.uint8), time.monotonic() + 10)
        assert b.error is not None


def test_messages_before_their_receive_are_held_within_the_bound_and_push_back() -> None:
    """A sender far ahead of its receiver: the receiver holds at most early_bytes (or one
    message) of them, the rest waits in the sender (its sends stay unfinished: TCP's
    flow control), and once the receives are posted every message lands whole, in order."""
    # 128 MiB against a 4 MiB bound: more than the kernel buffers on both sides (tcp_rmem
    # autotunes to 32 MiB here) can take while the receiver holds back.
    limit, size, count = 4 << 20, 1 << 20, 128
    peers = tuple(PeerAddress("127.0.0.1", port) for port in free_ports(2))
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                TcpEndpoint.connect, MeshOptions(r, peers, SECRET, connect_timeout=20.0, early_bytes=limit)
            )
            for r in range(2)
        ]
        a, b = (f.result() for f in futures)
    try:
        rng = np.random.default_rng(7)
        messages = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(count)]
        sends = [a.send(1, 100 + i, m) for i, m in enumerate(messages)]
        time.sleep(1.0)  # long enough for loopback to move it all if nothing held it back
        held = b.early_bytes(0)
        assert 0 < held <= limit, held
        assert not all(request.done() for request in sends), "no back-pressure reached the sender"
        # Held back by the receiver, not silent: its heartbeats wait behind these bytes.
        assert time.monotonic() - b.heard_at(0) < 0.05
        deadline = time.monotonic() + 30
        outs = [np.zeros(size, np.uint8) for _ in range(count)]
        receives = [b.post_recv(0, 100 + i, out) for i, out in enumerate(outs)]
        for request in [*receives, *sends]:
            request.wait(deadline)
        for i, (sent, got) in enumerate(zip(messages, outs, strict=True)):
            assert np.array_equal(sent, got), f"message {i}"
        assert b.early_bytes(0) == 0
        last = b.heard_at(0)  # the last message's end: silence counts from there
        time.sleep(0.3)
        assert b.heard_at(0) == last and time.monotonic() - last >= 0.3
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.close(), (a, b)))
    assert _threads() == set()


def test_a_message_written_in_pieces_lands_whole_and_one_cut_short_is_a_lost_peer() -> None:
    """The reader's one read per header and per payload waits for every byte; a peer
    that hangs up mid-message is gone, not a message received."""
    payload = np.arange(1000, dtype=np.uint8)
    with pair() as (a, b):
        sock = a._conns[1].sock
        out = np.zeros(payload.size, np.uint8)
        request = b.post_recv(0, 5, out)
        frame = struct.pack("<QQ", 5, payload.nbytes) + payload.tobytes()
        for piece in (frame[:3], frame[3:16], frame[16:400], frame[400:]):
            sock.sendall(piece)
            time.sleep(0.05)
        request.wait(time.monotonic() + 10)
        np.testing.assert_array_equal(out, payload)
        cut = b.post_recv(0, 6, np.zeros(payload.size, np.uint8))
        sock.sendall(struct.pack("<QQ", 6, payload.nbytes) + payload[:100].tobytes())
        time.sleep(0.1)
        sock.shutdown(2)  # no goodbye: the peer is gone mid-message
        with pytest.raises(UnavailableError, match="rank 0"):
            cut.wait(time.monotonic() + 10)


def test_a_receive_that_times_out_names_its_message_and_peer() -> None:
    with pair() as (_, b):
        waiting = b.post_recv(0, 9, np.zeros(4, np.uint8))
        with pytest.raises(CollectiveTimeoutError, match="timed out waiting for message 9 from rank 0"):
            waiting.wait(time.monotonic() + 0.3)


def test_a_receive_posted_after_its_connection_ended_fails_at_once() -> None:
    """A channel taken before its peer went away: a receive posted on it once the reader
    is gone calls back at once with the loss (nothing else would ever finish it); a
    message that came before the loss is still taken."""
    with pair() as (a, b):
        into = b.channel(0)
        a.send(1, 39, np.arange(8, dtype=np.uint8)).wait(time.monotonic() + 10)
        time.sleep(0.2)  # it waits unexpected on b's side
        a._conns[1].sock.shutdown(socket.SHUT_RDWR)  # no goodbye: the peer is gone
        reader = b._conns[0].reader
        assert reader is not None
        reader.join(10)
        assert not reader.is_alive() and b.error is not None
        seen: list[object] = []
        request = into.post(40, np.zeros(8, np.uint8), lambda r: seen.append(r.error))
        assert request.done and len(seen) == 1 and isinstance(seen[0], UnavailableError), seen
        early = np.zeros(8, np.uint8)
        request = into.post(39, early, lambda r: seen.append(r.error))
        assert request.done and seen[1:] == [None], seen
        np.testing.assert_array_equal(early, np.arange(8, dtype=np.uint8))
