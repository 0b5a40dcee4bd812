"""Bounded input (issue 8, points 1, 2 and the closed pipe of 4): every field of every
request is checked against the limits before anything is built from it, undecodable bytes
are INVALID_ARGUMENT on every RPC and on the trigger socket, and nothing is half-created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import lpsync_client
from lpsync.daemon.launch import serving
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc
from tests.daemon.harness import ROOT, DaemonProcess, shm_segments
from tests.daemon.probes import SERVICE, health_seconds, raw_stream, raw_unary, usage

S = grpc.StatusCode
GARBAGE = {
    "bad wire type": b"\xff\xff\xff\xff",
    "truncated field": b"\x0a\x05ab",
    "varint too long": b"\x08" + b"\xff" * 11,
}


def bad_utf8(message) -> bytes | None:
    """Bytes whose first string field (searched depth first) holds invalid UTF-8."""
    for field in message.fields:
        if field.type == field.TYPE_STRING:
            return bytes([field.number << 3 | 2, 2]) + b"\xff\xfe"
        if field.type == field.TYPE_MESSAGE and (inner := bad_utf8(field.message_type)):
            return bytes([field.number << 3 | 2, len(inner)]) + inner
    return None


def garbage(message) -> dict[str, bytes]:
    utf8 = bad_utf8(message)
    return {**GARBAGE, **({"invalid utf-8": utf8} if utf8 else {})}


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _sessions(stub) -> list:
    return list(stub.Status(pb.StatusRequest()).sessions)


def test_huge_world_size_is_refused_and_nothing_grows(daemon) -> None:
    """The issue's trial: world_size ~2**31 built per-rank state (9 GB, deaf to SIGTERM)."""
    before = usage(daemon.pid)
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = pb_grpc.LpSyncStub(channel)
        for world in (1 << 31, (1 << 32) - 1, 65537):
            code, details = _code(
                lambda w=world: stub.Attach(pb.AttachRequest(job="huge", rank=0, world_size=w), timeout=5)
            )
            assert code == S.INVALID_ARGUMENT
            assert f"world_size {world}" in details and "65536" in details
            assert "--max-world-size" in details
        # Within the limit, but a one-node job of 65536 ranks needs 65536 sessions here.
        code, details = _code(
            lambda: stub.Attach(pb.AttachRequest(job="huge", rank=0, world_size=65536), timeout=5)
        )
        assert code == S.RESOURCE_EXHAUSTED and "--max-sessions" in details, details
        assert _sessions(stub) == []  # nothing half-created
        # The job name is free: no job was left behind.
        sid = stub.Attach(pb.AttachRequest(job="huge", rank=0, world_size=1)).session_id
        stub.Detach(pb.DetachRequest(session_id=sid))
        assert health_seconds(channel) < 1.0
    grown = usage(daemon.pid).rss - before.rss
    assert grown < 30 << 20, f"RSS grew by {grown} bytes"
    start = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - start < 5.0


def _attach_fields_cases():
    yield "empty job", dict(job="", world_size=1), S.INVALID_ARGUMENT, "job"
    yield "long job", dict(job="j" * 257, world_size=1), S.INVALID_ARGUMENT, "--max-name-length"
    yield "control char", dict(job="a\nb", world_size=1), S.INVALID_ARGUMENT, "job"
    yield "world 0", dict(job="w", world_size=0), S.INVALID_ARGUMENT, "world_size 0"
    yield "rank out", dict(job="w", rank=2, world_size=2), S.INVALID_ARGUMENT, "rank 2"
    yield (
        "local world",
        dict(job="w", world_size=2, local_world_size=3),
        S.INVALID_ARGUMENT,
        "local_world_size 3",
    )
    yield (
        "local rank",
        dict(job="w", world_size=2, local_world_size=2, local_rank=2),
        S.INVALID_ARGUMENT,
        "local_rank 2",
    )
    yield "pid", dict(job="w", world_size=1, pid=(1 << 32) - 1), S.INVALID_ARGUMENT, "pid"


@pytest.fixture
def attached(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = pb_grpc.LpSyncStub(channel)
        sid = stub.Attach(pb.AttachRequest(job="fields", rank=0, world_size=2)).session_id
        handle = stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=64)).handle
        yield stub, sid, handle
        stub.Detach(pb.DetachRequest(session_id=sid))


def test_every_request_field_is_checked(daemon, attached) -> None:
    stub, sid, handle = attached
    cases = []
    for what, fields, code, needle in _attach_fields_cases():
        cases.append((what, lambda f=fields: stub.Attach(pb.AttachRequest(**f)), code, needle))

    def coll(**fields):
        base = dict(
            session_id=sid,
            sequence=1,
            op="allreduce",
            dtype="float32",
            count=4,
            input=pb.BufferRef(handle=handle),
        )
        return lambda: stub.Collective(pb.CollectiveRequest(**{**base, **fields}), timeout=5)

    for t in (float("nan"), float("inf"), float("-inf"), -1.0, 1e9):
        cases.append((f"timeout {t}", coll(timeout=t), S.INVALID_ARGUMENT, "timeout"))
    cases += [
        ("count 2**63-1", coll(count=(1 << 63) - 1), S.INVALID_ARGUMENT, "count"),
        ("count -1", coll(count=-1), S.INVALID_ARGUMENT, "count"),
        ("long name", coll(name="n" * 300), S.INVALID_ARGUMENT, "--max-name-length"),
        ("control name", coll(name="a\x00b"), S.INVALID_ARGUMENT, "name"),
        ("long algorithm", coll(algorithm="x" * 10000), S.INVALID_ARGUMENT, "algorithm"),
        ("reduce op", coll(reduce_op="nope"), S.INVALID_ARGUMENT, "reduce_op"),
        ("empty op", coll(op=""), S.INVALID_ARGUMENT, "op"),
        ("empty dtype", coll(dtype=""), S.INVALID_ARGUMENT, "dtype"),
        (
            "negative offset",
            coll(input=pb.BufferRef(handle=handle, offset=-8)),
            S.INVALID_ARGUMENT,
            "input.offset",
        ),
        (
            "huge offset",
            coll(input=pb.BufferRef(handle=handle, offset=1 << 62)),
            S.INVALID_ARGUMENT,
            "input.offset",
        ),
        ("root", coll(op="broadcast", root=(1 << 32) - 1), S.INVALID_ARGUMENT, "root"),
        ("unknown handle", coll(input=pb.BufferRef(handle=(1 << 64) - 1)), S.NOT_FOUND, "handle"),
        (
            "long session id",
            lambda: stub.Allocate(pb.AllocateRequest(session_id="s" * 10000, nbytes=8)),
            S.INVALID_ARGUMENT,
            "session_id",
        ),
        (
            "nbytes -1",
            lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=-1)),
            S.INVALID_ARGUMENT,
            "nbytes",
        ),
        (
            "nbytes 2**63-1",
            lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=(1 << 63) - 1)),
            S.RESOURCE_EXHAUSTED,
            "--max-buffer-bytes",
        ),
        (
            "device",
            lambda: stub.Register(pb.RegisterRequest(session_id=sid, nbytes=8, device="gpu" * 1000)),
            S.INVALID_ARGUMENT,
            "device",
        ),
        (
            "release unknown",
            lambda: stub.Release(pb.ReleaseRequest(session_id=sid, handle=(1 << 64) - 1)),
            S.NOT_FOUND,
            "handle",
        ),
    ]
    for what, call, want, needle in cases:
        code, details = _code(call)
        assert code == want, f"{what}: {code} {details}"
        assert needle in details, f"{what}: {details!r} does not name {needle!r}"
        assert len(details) < 600, f"{what}: the message echoes the whole value"
    assert {s.job for s in _sessions(stub)} == {"fields"}  # nothing half-created
    assert len(shm_segments(daemon.pid)) == 1


def test_session_buffer_and_byte_limits(tmp_path: Path) -> None:
    # One limit from the environment (flags > env > TOML, like every setting).
    d = DaemonProcess(
        tmp_path,
        "--max-total-bytes",
        str(1 << 20),
        "--max-session-buffers",
        "4",
        "--max-session-bytes",
        str(768 << 10),
        env={"LPSYNC_MAX_SESSIONS": "3"},
    )
    try:
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            stub = pb_grpc.LpSyncStub(channel)
            sids = [stub.Attach(pb.AttachRequest(job=f"s{i}", world_size=1)).session_id for i in range(3)]
            code, details = _code(lambda: stub.Attach(pb.AttachRequest(job="s3", world_size=1)))
            assert code == S.RESOURCE_EXHAUSTED and "--max-sessions 3" in details, details
            stub.Detach(pb.DetachRequest(session_id=sids.pop()))
            sids.append(stub.Attach(pb.AttachRequest(job="s3", world_size=1)).session_id)
            a, b, _ = sids
            stub.Allocate(pb.AllocateRequest(session_id=a, nbytes=600 << 10))
            code, details = _code(lambda: stub.Allocate(pb.AllocateRequest(session_id=a, nbytes=200 << 10)))
            assert code == S.RESOURCE_EXHAUSTED and "--max-session-bytes" in details, details
            code, details = _code(lambda: stub.Allocate(pb.AllocateRequest(session_id=b, nbytes=600 << 10)))
            assert code == S.RESOURCE_EXHAUSTED and "--max-total-bytes" in details, details
            handles = [stub.Allocate(pb.AllocateRequest(session_id=b, nbytes=8)).handle for _ in range(4)]
            code, details = _code(lambda: stub.Register(pb.RegisterRequest(session_id=b, nbytes=8)))
            assert code == S.RESOURCE_EXHAUSTED and "--max-session-buffers 4" in details
            stub.Release(pb.ReleaseRequest(session_id=b, handle=handles[0]))
            stub.Register(pb.RegisterRequest(session_id=b, nbytes=8))
            status = stub.Status(pb.StatusRequest())
            assert sorted(x.shm_name for x in status.buffers) == shm_segments(d.pid)
            assert len(status.buffers) == 5
    finally:
        d.stop_and_check()


def test_daemon_refuses_bad_limit_settings(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "daemon",
            "--socket",
            str(tmp_path / "s"),
            "--max-world-size",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "max_world_size must be positive" in out.stderr
    helptext = subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    ).stdout
    for flag in (
        "--max-world-size",
        "--max-sessions",
        "--max-buffer-bytes",
        "--max-session-bytes",
        "--max-total-bytes",
        "--max-session-buffers",
        "--max-name-length",
        "--max-pending",
        "--max-queued",
    ):
        assert flag in helptext


def test_undecodable_requests_are_invalid_argument_on_every_rpc(daemon) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        for method in SERVICE.methods:
            for what, payload in garbage(method.input_type).items():
                if method.client_streaming:
                    code, details, _ = raw_stream(channel, [payload], method=method.name)
                else:
                    code, details = raw_unary(channel, method.name, payload)
                assert code == S.INVALID_ARGUMENT, f"{method.name}, {what}: {code} {details}"
                assert method.input_type.full_name in details and "not a valid" in details
        code, details = raw_unary(channel, "Check", GARBAGE["bad wire type"], service="grpc.health.v1.Health")
        assert code == S.INVALID_ARGUMENT and "HealthCheckRequest" in details
        code, details, _ = raw_stream(
            channel,
            [GARBAGE["bad wire type"]],
            method="ServerReflectionInfo",
            service="grpc.reflection.v1alpha.ServerReflection",
        )
        assert code == S.INVALID_ARGUMENT and "ServerReflectionRequest" in details, details
        # A good open, then garbage: the stream ends INVALID_ARGUMENT and so does its session.
        stub = pb_grpc.LpSyncStub(channel)
        sid = stub.Attach(pb.AttachRequest(job="garbled", world_size=1)).session_id
        opening = pb.SessionRequest(request_id=1, open=pb.SessionOpen(session_id=sid))
        code, details, replies = raw_stream(
            channel, [opening.SerializeToString(), GARBAGE["truncated field"]]
        )
        assert code == S.INVALID_ARGUMENT and "SessionRequest" in details, details
        assert len(replies) == 1  # the opened reply came first
        deadline = time.monotonic() + 5
        while _sessions(stub) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sessions(stub) == []
        assert health_seconds(channel) < 1.0


def _seqpacket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(15)
    sock.connect(path)
    return sock


def _reason(sock: socket.socket) -> pb.CollectiveResult:
    reply = pb.SessionResponse.FromString(sock.recv(1 << 16))
    assert reply.request_id == 0 and reply.WhichOneof("body") == "result", reply
    assert sock.recv(1 << 16) == b""  # then the daemon closed it
    return reply.result


def test_trigger_socket_closes_bad_connections_with_a_reason(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "--max-sessions", "3")
    trigger = d.socket + ".trigger"
    try:
        silent = _seqpacket(trigger)  # says nothing: closed after the open timeout
        started = time.monotonic()
        for payload in garbage(pb.SessionRequest.DESCRIPTOR).values():
            with _seqpacket(trigger) as sock:
                sock.send(payload)
                result = _reason(sock)
                assert result.code == "INVALID_ARGUMENT" and "not a SessionRequest" in result.message
                # Closed by the daemon, its slot free again: the next connection is not
                # refused for --max-sessions (seen under load, a reset instead of a reason).
                assert sock.recv(1 << 16) == b""
        with _seqpacket(trigger) as a, _seqpacket(trigger) as b, _seqpacket(trigger) as c:
            result = _reason(c)  # silent, a and b hold all 3 slots
            assert result.code == "RESOURCE_EXHAUSTED" and "--max-sessions" in result.message
            del a, b
        # After open, a malformed packet fails what the client waits for, with the reason.
        with lpsync_client.connect(
            d.socket, job="tg", rank=0, world_size=2, timeout=30, trigger="socket"
        ) as client:
            future = client.allreduce_async(client.zeros(4))
            client._trigger._sock.send(GARBAGE["bad wire type"])
            with pytest.raises(lpsync_client.InvalidArgumentError) as info:
                future.result(timeout=10)
            assert "trigger socket" in str(info.value)
        result = _reason(silent)
        assert result.code == "INVALID_ARGUMENT" and "open{session_id}" in result.message
        assert 9 < time.monotonic() - started < 20
        silent.close()
        assert serving(d.socket)
    finally:
        d.stop_and_check()


def test_output_into_a_closed_pipe_ends_quietly(daemon) -> None:
    for args in (
        ["status", "--socket", daemon.socket, "--json"],
        ["simulate", "--op", "allreduce", "--nodes", "2,4,8", "--bytes", "1MiB"],
    ):
        read, write = os.pipe()
        os.close(read)  # the reader left before the first byte (`| head -0`)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "lpsync.cli", *args],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
        finally:
            os.close(write)
        assert out.stderr == "", out.stderr
        assert out.returncode == 141, args


def test_a_session_stream_that_never_opens_is_ended(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, env={"LPSYNC_STREAM_GRACE": "1"})
    try:
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            silent = threading.Event()

            def nothing():
                silent.wait(30)  # sends no message at all
                return
                yield

            start = time.monotonic()
            code, details = _code(lambda: list(pb_grpc.LpSyncStub(channel).Session(nothing(), timeout=20)))
            silent.set()
            assert code == S.INVALID_ARGUMENT and "open{session_id}" in details, details
            assert 0.5 < time.monotonic() - start < 10
            assert health_seconds(channel) < 1.0
    finally:
        d.stop_and_check()


def test_shared_memory_the_kernel_refuses_is_resource_exhausted() -> None:
    """Out of file descriptors (or /dev/shm space): RESOURCE_EXHAUSTED, not an OSError that
    would reach gRPC as UNKNOWN."""
    script = (
        "import os, resource\n"
        "from lpsync.errors import ResourceExhaustedError\n"
        "from lpsync.memory import SharedSegment\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
        "fds = []\n"
        "try:\n"
        "    while True:\n"
        "        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError:\n"
        "    pass\n"
        "try:\n"
        "    SharedSegment.create(64)\n"
        "except ResourceExhaustedError as error:\n"
        "    print('RESOURCE_EXHAUSTED', error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.startswith("RESOURCE_EXHAUSTED"), out.stdout + out.stderr
    assert "Too many open files" in out.stdout


def test_a_full_dev_shm_is_resource_exhausted_not_sigbus(tmp_path: Path) -> None:
    """Segments were sparse: on a full /dev/shm Allocate succeeded and the first write into
    the buffer killed the writer (the daemon) with SIGBUS. Pages are reserved at creation."""
    if os.geteuid() != 0 or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs root and unshare for a private, 4 MiB /dev/shm")
    out = subprocess.run(
        [
            "/usr/bin/unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=4m tmpfs /dev/shm && "
            f"exec {sys.executable} -m tests.daemon.shm_full {tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert "RESOURCE_EXHAUSTED" in out.stdout and "No space left" in out.stdout, out.stdout + out.stderr
    assert "STOPPED CLEANLY" in out.stdout, out.stdout + out.stderr
