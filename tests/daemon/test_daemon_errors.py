"""The error table of DESIGN.md, for real: mismatch, missing rank, killed client, bad
requests, wrong token, job isolation."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import lpsync_client
from lpsync.daemon.launch import serving
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc
from tests.daemon.harness import DaemonProcess, helper_context, run_ranks, shm_segments
from tests.daemon.workers import attach_and_wait, isolated, mismatch


def test_mismatch_names_ranks_and_fields(daemon) -> None:
    r0, r1 = run_ranks(2, mismatch, daemon.socket, "mm")
    for r in (r0, r1):
        name, message, state = r["count"]
        assert name == "MismatchError"
        assert "count" in message and "rank 0=8" in message and "rank 1=4" in message
        assert state == "INTACT"
        name, message, _ = r["dtype"]
        assert name == "MismatchError" and "dtype" in message
        assert r["after"] == [3, 3, 3]


def test_missing_rank_deadline_names_it(daemon) -> None:
    with lpsync_client.connect(daemon.socket, job="lonely", rank=0, world_size=3) as c:
        x = c.zeros(4)
        start = time.monotonic()
        with pytest.raises(lpsync_client.TimeoutError) as info:
            c.allreduce(x, timeout=0.5)
        elapsed = time.monotonic() - start
        assert 0.4 < elapsed < 3.0
        assert "rank(s) 1, 2 did not arrive" in str(info.value)
        assert info.value.code == "DEADLINE_EXCEEDED" and info.value.buffer_state == "INTACT"


@pytest.mark.parametrize("trigger", ["grpc", "socket"])
def test_killed_client_aborts_others_and_frees_buffers(daemon, trigger: str) -> None:
    ctx = helper_context()
    ready = ctx.Event()
    victim = ctx.Process(target=attach_and_wait, args=(1, daemon.socket, "kill", 2, ready, 120.0, trigger))
    victim.start()
    try:
        assert ready.wait(30)
        with lpsync_client.connect(
            daemon.socket, job="kill", rank=0, world_size=2, timeout=60, trigger=trigger
        ) as c:
            x = c.zeros(1000)
            future = c.allreduce_async(x)
            time.sleep(0.3)  # rank 0 is now waiting inside the collective
            before = len(shm_segments(daemon.pid))
            assert before >= 3  # rank 0's buffer and rank 1's two
            victim.kill()
            killed = time.monotonic()
            with pytest.raises(lpsync_client.AbortedError) as info:
                future.result(timeout=10)
            took = time.monotonic() - killed
            assert took < 2.0
            assert "rank 1" in str(info.value) and info.value.buffer_state == "INTACT"
            # Its buffers are gone; rank 0's remain.
            status = c.status()
            assert {s.rank for s in status.sessions if s.job == "kill"} == {0}
            assert all(b.session_id == c.session_id for b in status.buffers)
            # The job stays broken (fails at once) until rank 1 attaches again.
            start = time.monotonic()
            with pytest.raises(lpsync_client.AbortedError):
                c.allreduce(x, timeout=30)
            assert time.monotonic() - start < 1.0
    finally:
        victim.kill()
        victim.join(10)
    assert serving(daemon.socket)


def _stub(socket: str, metadata=None):
    channel = grpc.insecure_channel(f"unix:{socket}")
    return channel, pb_grpc.LpSyncStub(channel)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_requests_get_clear_status_and_daemon_stays_up(daemon) -> None:
    channel, stub = _stub(daemon.socket)
    with channel:
        sid = stub.Attach(pb.AttachRequest(job="bad", rank=0, world_size=1)).session_id
        S = grpc.StatusCode
        cases = {
            "unknown session": (
                lambda: stub.Allocate(pb.AllocateRequest(session_id="nope", nbytes=8)),
                S.NOT_FOUND,
            ),
            "negative size": (
                lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=-1)),
                S.INVALID_ARGUMENT,
            ),
            "absurd size": (
                lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=1 << 60)),
                S.RESOURCE_EXHAUSTED,
            ),
            "unknown handle": (
                lambda: stub.Collective(
                    pb.CollectiveRequest(
                        session_id=sid,
                        sequence=1,
                        op="allreduce",
                        dtype="float32",
                        count=4,
                        input=pb.BufferRef(handle=999),
                    )
                ),
                S.NOT_FOUND,
            ),
            "unknown dtype": (
                lambda: stub.Collective(
                    pb.CollectiveRequest(
                        session_id=sid, sequence=1, op="allreduce", dtype="complex64", count=4
                    )
                ),
                S.INVALID_ARGUMENT,
            ),
            "unknown op": (
                lambda: stub.Collective(
                    pb.CollectiveRequest(session_id=sid, sequence=1, op="alltoall", dtype="float32", count=4)
                ),
                S.INVALID_ARGUMENT,
            ),
            "release unknown": (
                lambda: stub.Release(pb.ReleaseRequest(session_id=sid, handle=12345)),
                S.NOT_FOUND,
            ),
            "second attach": (
                lambda: stub.Attach(pb.AttachRequest(job="bad", rank=0, world_size=1)),
                S.ALREADY_EXISTS,
            ),
            "rank out of world": (
                lambda: stub.Attach(pb.AttachRequest(job="x", rank=2, world_size=2)),
                S.INVALID_ARGUMENT,
            ),
        }
        buffer = stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=16))
        cases["count beyond buffer"] = (
            lambda: stub.Collective(
                pb.CollectiveRequest(
                    session_id=sid,
                    sequence=1,
                    op="allreduce",
                    dtype="float32",
                    count=5,
                    input=pb.BufferRef(handle=buffer.handle),
                )
            ),
            S.INVALID_ARGUMENT,
        )
        cases["absurd timeout"] = (
            lambda: stub.Collective(
                pb.CollectiveRequest(
                    session_id=sid,
                    sequence=1,
                    op="allreduce",
                    dtype="float32",
                    count=4,
                    timeout=1e30,
                    input=pb.BufferRef(handle=buffer.handle),
                )
            ),
            S.INVALID_ARGUMENT,
        )
        cases["negative count"] = (
            lambda: stub.Collective(
                pb.CollectiveRequest(
                    session_id=sid,
                    sequence=1,
                    op="allreduce",
                    dtype="float32",
                    count=-3,
                    input=pb.BufferRef(handle=buffer.handle),
                )
            ),
            S.INVALID_ARGUMENT,
        )
        for what, (call, want) in cases.items():
            code, details = _code(call)
            assert code == want, f"{what}: {code} {details}"
            assert details, what
        # Still serving, and the session still works.
        assert serving(daemon.socket)
        reply = stub.Collective(
            pb.CollectiveRequest(
                session_id=sid,
                sequence=1,
                op="allreduce",
                dtype="float32",
                count=4,
                input=pb.BufferRef(handle=buffer.handle),
            )
        )
        assert reply.algorithm == "direct"
        stub.Detach(pb.DetachRequest(session_id=sid))
    # Client-side typed errors for the same mistakes.
    with lpsync_client.connect(daemon.socket, job="bad2", rank=0, world_size=1) as c:
        with pytest.raises(lpsync_client.ResourceExhaustedError):
            c.empty(1 << 58, "uint8")
        with pytest.raises(lpsync_client.InvalidArgumentError):
            c.allreduce(np.zeros(3, np.complex64))
        with pytest.raises(lpsync_client.AlreadyExistsError):
            lpsync_client.connect(daemon.socket, job="bad2", rank=0, world_size=1)


def test_a_repeated_request_on_a_released_buffer_is_refused(daemon) -> None:
    """A repeat of a request skips its checks (handlers.py keeps them per session): the
    buffer's release must end that, so the same request is NOT_FOUND, not run on memory
    the session gave back."""
    channel, stub = _stub(daemon.socket)
    with channel:
        sid = stub.Attach(pb.AttachRequest(job="released", rank=0, world_size=1)).session_id
        handle = stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=16)).handle

        def allreduce(sequence: int):
            ref = pb.BufferRef(handle=handle)
            request = pb.CollectiveRequest(
                session_id=sid, sequence=sequence, op="allreduce", dtype="float32", count=4, input=ref
            )
            return stub.Collective(request)

        assert allreduce(1).algorithm == allreduce(2).algorithm == "direct"  # the second: a repeat
        stub.Release(pb.ReleaseRequest(session_id=sid, handle=handle))
        code, details = _code(lambda: allreduce(3))
        assert code == grpc.StatusCode.NOT_FOUND and str(handle) in details, (code, details)
        stub.Detach(pb.DetachRequest(session_id=sid))


def test_wrong_token_is_unauthenticated(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    d = DaemonProcess(tmp_path, "--token-file", str(token))
    try:
        with pytest.raises(lpsync_client.UnauthenticatedError):
            lpsync_client.connect(d.socket, job="t", rank=0, world_size=1, token="wrong")
        with pytest.raises(lpsync_client.UnauthenticatedError):
            lpsync_client.connect(d.socket, job="t", rank=0, world_size=1)
        with lpsync_client.connect(d.socket, job="t", rank=0, world_size=1, token="s3cret") as c:
            c.allreduce(c.zeros(2))
    finally:
        d.stop_and_check()


def test_jobs_are_isolated(daemon) -> None:
    a = run_ranks(2, isolated, daemon.socket, "job-a", 1)
    b = run_ranks(2, isolated, daemon.socket, "job-b", 100)
    assert a[0] == a[1] == [3 + 2 * i for i in range(20)]
    assert b[0] == b[1] == [300 + 2 * i for i in range(20)]


def test_jobs_run_concurrently_without_crosstalk(daemon) -> None:
    import threading

    results = {}

    def job(name: str, value: int) -> None:
        results[name] = run_ranks(2, isolated, daemon.socket, name, value)

    threads = [threading.Thread(target=job, args=(n, v)) for n, v in (("c", 1), ("d", 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["c"][0] == [3 + 2 * i for i in range(20)]
    assert results["d"][1] == [300 + 2 * i for i in range(20)]


def test_failed_inplace_collective_reports_partial(daemon) -> None:
    from tests.daemon.workers import partial_inplace

    states = run_ranks(2, partial_inplace, daemon.socket, "partial")
    for s in states:
        assert "PARTIAL" in s[:3], s  # at least one attempt timed out while running
        # Out of place: the error carries no buffer state and the input is untouched.
        assert s[3] in ("out-of-place::1:1",), s


def test_trigger_socket_refuses_unknown_sessions(daemon) -> None:
    from lpsync_client._trigger import TriggerStream

    with pytest.raises(lpsync_client.NotFoundError):
        TriggerStream(daemon.socket + ".trigger", "not-a-session", 5.0)
    with lpsync_client.connect(daemon.socket, job="trig", rank=0, world_size=1, trigger="socket") as c:
        c.ping()
        c.ping(via="grpc")
        x = c.zeros(3)
        x[:] = 4
        c.allreduce(x, op="avg")
        assert x.tolist() == [4, 4, 4]
        with pytest.raises(lpsync_client.MismatchError.__mro__[1]):
            c.allreduce(c.zeros(3, "int8"), op="nonsense")
    assert serving(daemon.socket)


def test_unary_collective_reports_status_and_buffer_state(daemon) -> None:
    channel, stub = _stub(daemon.socket)
    with channel:
        sid = stub.Attach(pb.AttachRequest(job="unary", rank=0, world_size=2)).session_id
        buffer = stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=16))
        with pytest.raises(grpc.RpcError) as info:
            stub.Collective(
                pb.CollectiveRequest(
                    session_id=sid,
                    sequence=1,
                    op="allreduce",
                    dtype="float32",
                    count=4,
                    timeout=0.3,
                    input=pb.BufferRef(handle=buffer.handle),
                )
            )
        error = info.value
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "rank(s) 1 did not arrive" in error.details()
        trailers = dict(error.trailing_metadata())
        assert trailers["lpsync-error"] == "CollectiveTimeoutError"
        assert trailers["lpsync-buffer-state"] == "INTACT"
        stub.Detach(pb.DetachRequest(session_id=sid))


def test_a_cancelled_unary_collective_leaves_at_once(daemon) -> None:
    """Rank 0's unary call gives up after 0.5 s (its gRPC deadline; the collective's own
    timeout is 60 s): within 1 s the collective is no longer waiting, and rank 1, arriving
    later, gets the same AbortedError at once instead of waiting for a rank that left."""
    channel, stub = _stub(daemon.socket)
    with channel:
        sids = [stub.Attach(pb.AttachRequest(job="cancel", rank=r, world_size=2)).session_id for r in (0, 1)]
        buffers = [stub.Allocate(pb.AllocateRequest(session_id=s, nbytes=16)) for s in sids]

        def request(r: int) -> pb.CollectiveRequest:
            return pb.CollectiveRequest(
                session_id=sids[r],
                sequence=1,
                op="allreduce",
                dtype="float32",
                count=4,
                timeout=60,
                input=pb.BufferRef(handle=buffers[r].handle),
            )

        with pytest.raises(grpc.RpcError) as info:
            stub.Collective(request(0), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gave_up = time.monotonic()

        def waiting() -> int:
            (job,) = [j for j in stub.Status(pb.StatusRequest()).jobs if j.job == "cancel"]
            return len(job.waiting)

        while waiting() and time.monotonic() - gave_up < 5:
            time.sleep(0.05)
        assert waiting() == 0
        assert time.monotonic() - gave_up < 1.0, "the cancelled collective stayed pending"
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:
            stub.Collective(request(1), timeout=10)
        assert late.value.code() == grpc.StatusCode.ABORTED, late.value.details()
        assert "rank 0 cancelled its call" in late.value.details()
        assert time.monotonic() - started < 1.0
        # The job goes on: its next collective runs.
        replies = []
        for r in (0, 1):
            next_one = request(r)
            next_one.sequence = 2
            replies.append(stub.Collective.future(next_one, timeout=10))
        assert [f.result().algorithm for f in replies] == ["direct", "direct"]


@pytest.mark.parametrize("trigger", ["grpc", "socket"])
def test_a_cancelled_session_collective_leaves_at_once(daemon, trigger: str) -> None:
    """The same through a client's Session stream or trigger socket: cancelling the
    Future of a collective still waiting for rank 1 withdraws it within 1 s."""
    with (
        lpsync_client.connect(daemon.socket, job="cancel-s", rank=0, world_size=2, trigger=trigger) as c0,
        lpsync_client.connect(daemon.socket, job="cancel-s", rank=1, world_size=2, trigger=trigger) as c1,
    ):
        x0, x1 = c0.zeros(4), c1.zeros(4)
        future = c0.allreduce_async(x0, timeout=60)
        time.sleep(0.2)
        assert future.cancel()
        gave_up = time.monotonic()

        def waiting() -> int:
            return sum(len(j.waiting) for j in c0.status().jobs if j.job == "cancel-s")

        while waiting() and time.monotonic() - gave_up < 5:
            time.sleep(0.05)
        assert waiting() == 0 and time.monotonic() - gave_up < 1.0
        with pytest.raises(lpsync_client.AbortedError, match="rank 0 cancelled its call"):
            c1.allreduce(x1, timeout=10)
        # Both go on with the next collective.
        x0[:], x1[:] = 1, 2
        both = [c0.allreduce_async(x0), c1.allreduce_async(x1)]
        for f in both:
            f.result(10)
        assert x0.tolist() == x1.tolist() == [3, 3, 3, 3]


def test_a_refused_attach_fails_what_the_other_ranks_wait_for(daemon) -> None:
    """Rank 0 waits in an allreduce (60 s timeout) for rank 1, whose attach is refused (it
    brings another world size): rank 0 gets AbortedError naming rank 1 and why within a
    second, not at its timeout; once rank 1 attaches as it should, the job goes on."""
    channel, stub = _stub(daemon.socket)
    with channel:
        first = stub.Attach(pb.AttachRequest(job="refused", rank=0, world_size=2))
        buffer = stub.Allocate(pb.AllocateRequest(session_id=first.session_id, nbytes=16))

        def request(session: str, handle: int, sequence: int) -> pb.CollectiveRequest:
            return pb.CollectiveRequest(
                session_id=session,
                sequence=sequence,
                op="allreduce",
                dtype="float32",
                count=4,
                timeout=60,
                input=pb.BufferRef(handle=handle),
            )

        waiting = stub.Collective.future(request(first.session_id, buffer.handle, 1), timeout=30)
        time.sleep(0.3)  # rank 0 is waiting inside the collective
        refused_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as refusal:
            stub.Attach(pb.AttachRequest(job="refused", rank=1, world_size=3))
        assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as aborted:
            waiting.result()
        assert time.monotonic() - refused_at < 1.0
        assert aborted.value.code() == grpc.StatusCode.ABORTED, aborted.value.details()
        text = aborted.value.details()
        assert "rank 1 of job 'refused'" in text and "its attach was refused" in text, text
        assert "has world size 2; rank 1 attached with 3" in text, text
        # Rank 1 attaches as it should: the job's next collective runs.
        second = stub.Attach(pb.AttachRequest(job="refused", rank=1, world_size=2))
        other = stub.Allocate(pb.AllocateRequest(session_id=second.session_id, nbytes=16))
        replies = [
            stub.Collective.future(request(first.session_id, buffer.handle, 2), timeout=10),
            stub.Collective.future(request(second.session_id, other.handle, 2), timeout=10),
        ]
        assert [f.result().algorithm for f in replies] == ["direct", "direct"]
        # A duplicate of a live rank is refused without touching the job.
        with pytest.raises(grpc.RpcError) as duplicate:
            stub.Attach(pb.AttachRequest(job="refused", rank=1, world_size=2))
        assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
        replies = [
            stub.Collective.future(request(first.session_id, buffer.handle, 3), timeout=10),
            stub.Collective.future(request(second.session_id, other.handle, 3), timeout=10),
        ]
        assert [f.result().algorithm for f in replies] == ["direct", "direct"]
