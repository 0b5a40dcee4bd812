"""The fuzzed control plane (issue 8, point 3): requests for every RPC generated from the
proto's descriptors (fuzzing.py), raw bytes, other messages' bytes, cancelled calls and
streams that stop halfway, against a real daemon with real sessions attached. After every
case: health SERVING, no UNKNOWN/INTERNAL, and RSS, threads, fds and shared memory bounded
(every segment in /dev/shm belongs to a buffer the daemon reports).

The suite runs LPSYNC_FUZZ_EXAMPLES cases (default 300). The long run of
docs/reliability.md:  LPSYNC_FUZZ_EXAMPLES=10000 pytest -q tests/daemon/test_fuzz_control.py -s
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from lpsync.bench.runner import percentile
from lpsync_client.wire.proto import lpsync_pb2 as pb
from tests.daemon.fuzzing import SERVICE, Pool, Stream, Unary, build, cases, substitute
from tests.daemon.harness import DaemonProcess, shm_segments
from tests.daemon.probes import FORBIDDEN, health_seconds, usage

EXAMPLES = int(os.environ.get("LPSYNC_FUZZ_EXAMPLES", "300"))
# Small limits, so that fuzzed sizes stay cheap and every limit is reached now and then.
FLAGS = (
    "--max-buffer-bytes",
    str(1 << 20),
    "--max-session-bytes",
    str(4 << 20),
    "--max-total-bytes",
    str(32 << 20),
    "--max-pending",
    "256",
    "--max-sessions",
    "64",
    "--timeout",
    "5",
)
_INPUT = {m.name: m.input_type for m in SERVICE.methods}
# Client-side outcomes: the call's own deadline or cancellation, not the daemon's answer.
_CLIENT_SIDE = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    daemon = DaemonProcess(tmp_path_factory.mktemp("fuzz"), *FLAGS)
    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    pool = Pool(channel)
    stats = {"cases": 0, "codes": {}, "health": []}
    try:
        pool.ensure()
        time.sleep(0.5)
        yield daemon, channel, pool, usage(daemon.pid), stats
    finally:
        print(
            f"\nfuzz: {stats['cases']} cases; codes {sorted(stats['codes'].items())}; "
            f"health p50 {percentile(stats['health'] or [0.0], 50) * 1e3:.1f} ms, "
            f"max {max(stats['health'], default=0) * 1e3:.1f} ms; "
            f"usage at the end {usage(daemon.pid)}"
        )
        pool.close()
        channel.close()
        daemon.stop_and_check()


def _unary(channel: grpc.Channel, pool: Pool, case: Unary) -> grpc.StatusCode:
    payload = case.payload
    if isinstance(payload, dict):
        request = build(_INPUT[case.method], payload)
        substitute(request, pool.sessions, pool.handles)
        payload = request.SerializeToString()
    call = channel.unary_unary(f"/{SERVICE.full_name}/{case.method}")
    future = call.future(payload, timeout=0.3)
    if case.cancel:
        future.cancel()
    try:
        reply = future.result()
    except grpc.FutureCancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.RpcError as error:
        assert error.code() in _CLIENT_SIDE or error.details(), f"{error.code()} without text"
        return error.code()
    if case.method == "Attach":  # a fuzzed attach that succeeded: do not let it linger
        sid = pb.AttachResponse.FromString(reply).session_id
        pool.stub.Detach(pb.DetachRequest(session_id=sid), timeout=5)
    return grpc.StatusCode.OK


def _stream(channel: grpc.Channel, pool: Pool, case: Stream, n: int) -> grpc.StatusCode:
    messages = []
    sid = ""
    if case.opens:
        sid = pool.stub.Attach(pb.AttachRequest(job=f"fz-stream-{n}", world_size=1), timeout=5).session_id
        messages.append(pb.SessionRequest(request_id=1, open=pb.SessionOpen(session_id=sid)))
    for values in case.messages:
        request = build(pb.SessionRequest.DESCRIPTOR, values)
        substitute(request, pool.sessions, pool.handles)
        messages.append(request)
    call = pool.stub.Session(iter(messages), timeout=1.0)
    code = grpc.StatusCode.OK
    try:
        for _ in call:
            if case.stop == "cancel":
                call.cancel()  # stops halfway: the rest is never read
    except grpc.RpcError as error:
        code = error.code()
    if sid:
        try:
            pool.stub.Detach(pb.DetachRequest(session_id=sid), timeout=5)
        except grpc.RpcError as error:  # the stream's end may have ended it already
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
    return code


def _check_bounded(daemon: DaemonProcess, channel: grpc.Channel, pool: Pool, base, stats: dict) -> None:
    stats["health"].append(health_seconds(channel, timeout=5.0))
    now = usage(daemon.pid)
    assert now.rss < base.rss + (300 << 20), (base, now)
    assert now.threads <= base.threads + 24, (base, now)
    assert now.fds <= base.fds + 64, (base, now)
    # Every shared-memory segment belongs to a buffer the daemon reports (sessions that a
    # cancelled stream ended are freed asynchronously: allow them a moment).
    deadline = time.monotonic() + 5
    while True:
        status = pool.stub.Status(pb.StatusRequest(), timeout=5)
        # Buffers, and the doorbell pages of jobs with armed plans (docs/daemon.md).
        pages = [j.doorbell_page for j in status.jobs if j.doorbell_page]
        reported = sorted([b.shm_name for b in status.buffers] + pages)
        if reported == shm_segments(daemon.pid) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reported == shm_segments(daemon.pid)
    assert len(status.sessions) <= 64


@pytest.mark.timeout(max(300, EXAMPLES // 10))  # ~10 ms a case here; the long run needs more
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(case=cases())
def test_fuzzed_requests_never_hurt_the_daemon(target, case) -> None:
    daemon, channel, pool, base, stats = target
    pool.ensure()
    stats["cases"] += 1
    if isinstance(case, Unary):
        code = _unary(channel, pool, case)
    else:
        code = _stream(channel, pool, case, stats["cases"])
    stats["codes"][code.name] = stats["codes"].get(code.name, 0) + 1
    assert code not in FORBIDDEN, case
    _check_bounded(daemon, channel, pool, base, stats)


def test_fuzz_log_has_no_internal_errors(target) -> None:
    """Runs after the fuzz test (same module fixture): the daemon logged no bug."""
    daemon = target[0]
    text = Path(daemon.log).read_text()
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]
