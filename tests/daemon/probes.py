"""Looking at a running daemon from outside: raw calls, its resources, its health."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lpsync_client.wire.proto import lpsync_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["LpSync"]
# Codes a request may never get back, whatever it held (DESIGN.md's error table).
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def raw_unary(
    channel: grpc.Channel, method: str, payload: bytes, timeout: float = 5.0, service: str = SERVICE.full_name
) -> tuple[grpc.StatusCode, str]:
    """Send ``payload`` as the request bytes of a unary method; (code, details)."""
    call = channel.unary_unary(f"/{service}/{method}")  # no serializer: bytes as they are
    try:
        call(payload, timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def raw_stream(
    channel: grpc.Channel,
    payloads: list[bytes],
    timeout: float = 5.0,
    method: str = "Session",
    service: str = SERVICE.full_name,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    call = channel.stream_stream(f"/{service}/{method}")
    replies: list[bytes] = []
    try:
        for reply in call(iter(payloads), timeout=timeout):
            replies.append(reply)
    except grpc.RpcError as error:
        return error.code(), error.details() or "", replies
    return grpc.StatusCode.OK, "", replies


@dataclass(frozen=True)
class Usage:
    rss: int  # bytes
    threads: int
    fds: int


def usage(pid: int) -> Usage:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Usage(
        int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"]), len(os.listdir(f"/proc/{pid}/fd"))
    )


def health_seconds(channel: grpc.Channel, timeout: float = 5.0) -> float:
    """One health check's round trip; raises unless the daemon answers SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    start = time.perf_counter()
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    took = time.perf_counter() - start
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
    return took
