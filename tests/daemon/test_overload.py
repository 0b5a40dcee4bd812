"""Overload (issue 8, point 5): churning clients, a thousand pending collectives, clients
that stop reading, clients that register buffers until the limit. Queues stay bounded,
memory stays bounded, and a well-behaved job on the same daemon keeps getting correct
results."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

import lpsync_client
from lpsync.daemon.launch import serving
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc
from tests.daemon.harness import DaemonProcess, helper_context, run_ranks, shm_segments
from tests.daemon.overload_workers import churn, pending_partner, steady
from tests.daemon.probes import health_seconds, usage


@contextmanager
def steady_job(sock: str, tmp: Path, job: str = "steady"):
    """A 2-rank job checking its allreduces against numpy for as long as the block runs."""
    stop = tmp / f"stop-{job}"
    results: dict[str, object] = {}

    def body() -> None:
        try:
            results["ranks"] = run_ranks(2, steady, sock, job, str(stop), timeout=300)
        except BaseException as error:  # reported below
            results["error"] = error

    thread = threading.Thread(target=body)
    thread.start()
    time.sleep(2.0)  # spawned ranks attach and start looping
    try:
        yield results
    finally:
        stop.touch()
        thread.join(300)
    assert "error" not in results, results.get("error")
    for done, wrong in results["ranks"]:
        assert wrong == 0 and done > 5, results["ranks"]


def test_attach_detach_churn(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    try:
        base = usage(d.pid)
        with steady_job(d.socket, tmp_path):
            assert run_ranks(3, churn, d.socket, 25, timeout=300) == [25, 25, 25]
        time.sleep(0.5)
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            status = pb_grpc.LpSyncStub(channel).Status(pb.StatusRequest())
            assert list(status.sessions) == [] and list(status.buffers) == []
            health_seconds(channel)
        after = usage(d.pid)
        assert after.fds <= base.fds + 8, (base, after)
        assert after.threads <= base.threads + 8, (base, after)
        assert after.rss < base.rss + (60 << 20), (base, after)
        assert shm_segments(d.pid) == []
    finally:
        d.stop_and_check()


def _pending_job(sock: str, n: int, job: str) -> tuple[list, list[str]]:
    """Rank 0 (here) submits ``n`` collectives before rank 1 (a process) submits any."""
    ctx = helper_context()
    go = ctx.Event()
    outcome: dict[str, list] = {}
    partner = threading.Thread(
        target=lambda: outcome.setdefault("r1", run_ranks(1, pending_partner, sock, job, n, go, timeout=120))
    )
    with lpsync_client.connect(sock, job=job, rank=0, world_size=2, timeout=60) as c:
        inp = c.zeros((n, 4), "int64")
        out = c.zeros((n, 4), "int64")
        inp[:] = np.arange(n)[:, None]
        partner.start()
        futures = [c.allreduce_async(inp[i], out=out[i]) for i in range(n)]
        time.sleep(1.0)
        assert not any(f.done() and f.exception() is None for f in futures)
        go.set()
        mine = []
        for i, f in enumerate(futures):
            try:
                f.result(timeout=60)
                mine.append("ok" if out[i].tolist() == [3 * i] * 4 else f"wrong {out[i]}")
            except lpsync_client.LpsyncError as error:
                mine.append((type(error).__name__, str(error)))
        c.allreduce(c.zeros(2))
        partner.join(120)
    return mine, outcome["r1"][0]


def test_a_thousand_pending_collectives(daemon) -> None:
    mine, theirs = _pending_job(daemon.socket, 1000, "thousand")
    assert mine == ["ok"] * 1000
    assert theirs == ["ok"] * 1000
    assert serving(daemon.socket)


def test_pending_collectives_beyond_the_limit_are_refused_on_every_rank(tmp_path) -> None:
    d = DaemonProcess(tmp_path, "--max-pending", "100")
    try:
        mine, theirs = _pending_job(d.socket, 130, "bounded")
        assert mine[:100] == ["ok"] * 100 and theirs[:100] == ["ok"] * 100
        for name, message in mine[100:]:
            assert name == "ResourceExhaustedError" and "--max-pending 100" in message
        assert theirs[100:] == ["ResourceExhaustedError"] * 30
    finally:
        d.stop_and_check()


def test_slow_consumer_gets_back_pressure(tmp_path: Path) -> None:
    """A Session stream whose client sends and never reads: after --max-queued replies the
    daemon stops reading that stream, so its requests back up in the client."""
    d = DaemonProcess(tmp_path, "--max-queued", "16")
    try:
        # Without BDP probing the client's receive window stays at 64 kB: what it does not
        # read stays in the daemon's court, and the daemon must bound it.
        channel = grpc.insecure_channel(f"unix:{d.socket}", options=[("grpc.http2.bdp_probe", 0)])
        stub = pb_grpc.LpSyncStub(channel)
        sid = stub.Attach(pb.AttachRequest(job="slow", world_size=1)).session_id
        total, sent = 10_000, [0]
        fat = "n" * 1000  # a name over the limit: each request is answered at once

        def requests():
            yield pb.SessionRequest(request_id=0, open=pb.SessionOpen(session_id=sid))
            for i in range(1, total + 1):
                sent[0] = i
                yield pb.SessionRequest(request_id=i, collective=pb.CollectiveRequest(op="barrier", name=fat))

        base = usage(d.pid)
        call = stub.Session(requests(), timeout=120)
        time.sleep(4.0)  # the client reads nothing meanwhile
        stalled = sent[0]
        assert stalled < total, f"the daemon read all {total} requests"
        assert "session stream paused" in Path(d.log).read_text()
        grown = usage(d.pid).rss - base.rss
        assert grown < 50 << 20, grown
        assert health_seconds(channel) < 1.0
        with lpsync_client.connect(d.socket, job="other", rank=0, world_size=1) as c:
            x = c.zeros(4)
            x[:] = 2
            c.allreduce(x)
            assert x.tolist() == [2, 2, 2, 2]
        ids = [reply.request_id for reply in call]  # now read: everything arrives, in order
        assert ids == list(range(total + 1))
        channel.close()
    finally:
        d.stop_and_check()


def test_trigger_client_that_stops_reading_is_held_back(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "--max-queued", "16")
    try:
        with lpsync_client.connect(d.socket, job="deaf", rank=0, world_size=1, trigger="grpc") as c:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(20)
            sock.connect(d.socket + ".trigger")
            sock.send(pb.SessionRequest(open=pb.SessionOpen(session_id=c.session_id)).SerializeToString())
            opened = pb.SessionResponse.FromString(sock.recv(1 << 16))
            assert opened.WhichOneof("body") == "opened"
            base = usage(d.pid)
            sock.settimeout(3.0)
            sent, start = 0, time.monotonic()
            with pytest.raises(TimeoutError):  # our sends block: the daemon stopped reading
                while time.monotonic() - start < 60:
                    sock.send(pb.SessionRequest(request_id=sent + 1, ping=pb.Ping()).SerializeToString())
                    sent += 1
            assert usage(d.pid).rss < base.rss + (30 << 20)
            c.ping(via="grpc")  # the session and the daemon are fine meanwhile
            x = c.zeros(3)
            c.allreduce(x)
            # Reading again: every ping is answered, in order, and the connection works.
            ids = [pb.SessionResponse.FromString(sock.recv(1 << 16)).request_id for _ in range(sent)]
            assert ids == list(range(1, sent + 1))
            sock.send(pb.SessionRequest(request_id=sent + 1, ping=pb.Ping()).SerializeToString())
            assert pb.SessionResponse.FromString(sock.recv(1 << 16)).request_id == sent + 1
            sock.close()
        assert serving(d.socket)
    finally:
        d.stop_and_check()


def test_registering_until_the_limit(tmp_path: Path) -> None:
    d = DaemonProcess(
        tmp_path,
        "--max-session-buffers",
        "32",
        "--max-session-bytes",
        str(4 << 20),
        "--max-total-bytes",
        str(8 << 20),
    )
    try:
        base = usage(d.pid)
        with steady_job(d.socket, tmp_path):
            clients = [
                lpsync_client.connect(d.socket, job=f"greedy{i}", rank=0, world_size=1) for i in range(3)
            ]
            try:
                held: list = []
                reasons = []
                for c, size in zip(clients, (16 << 10, 1 << 20, 1 << 20), strict=True):
                    with pytest.raises(lpsync_client.ResourceExhaustedError) as info:
                        for _ in range(1000):
                            held.append(c.register(np.zeros(size // 4, np.float32)))
                    reasons.append(str(info.value))
                assert "--max-session-buffers 32" in reasons[0]
                assert "--max-session-bytes" in reasons[1]
                assert "--max-total-bytes" in reasons[2]
                assert usage(d.pid).rss < base.rss + (60 << 20)
                # Still usable within what they hold.
                x = held[0]
                clients[0].allreduce(x)
            finally:
                for c in clients:
                    c.close()
        assert len(shm_segments(d.pid)) == 0
    finally:
        d.stop_and_check()


@pytest.mark.parametrize("trigger", ["grpc", "socket"])
def test_a_cancelled_collective_does_not_break_the_client(daemon, trigger: str) -> None:
    """The reply to a collective whose Future the caller cancelled used to raise in the
    client's reader thread, which died: every later request of that client hung. Rank 1
    arrives first, so rank 0's request completes the collective before its cancel reaches
    the daemon (same connection, in order): it runs, and its reply finds no taker."""
    with (
        lpsync_client.connect(
            daemon.socket, job="cx", rank=0, world_size=2, timeout=30, trigger=trigger
        ) as a,
        lpsync_client.connect(
            daemon.socket, job="cx", rank=1, world_size=2, timeout=30, trigger=trigger
        ) as b,
    ):
        x, y = a.zeros(4), b.zeros(4)
        cancelled = 0
        for _ in range(20):  # until a cancel beats the reply (almost always the first)
            other = b.allreduce_async(y)
            time.sleep(0.05)  # rank 1's request is in
            first = a.allreduce_async(x)
            cancelled += first.cancel()
            other.result(timeout=10)  # it ran: the cancel came after it was complete
            if cancelled:
                break
        assert cancelled
        x[:], y[:] = 1, 2
        second = a.allreduce_async(x)
        b.allreduce(y)
        assert second.result(timeout=10).tolist() == [3, 3, 3, 3]
