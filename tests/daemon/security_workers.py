"""Bodies of the security tests that run in spawned processes (importable by name)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket

import numpy as np

import lpsync_client


def as_user(uid: int, gid: int, groups: list[int], sock: str, trigger: str, shm: str) -> dict[str, str]:
    """Drop to ``uid``/``gid`` (+ ``groups``), then try the daemon's three local surfaces:
    attach over gRPC, connect to the trigger socket, open a buffer's shared memory.
    Each outcome is "ok" or what refused it."""
    # Everything this body needs is imported before the privileges go: the interpreter's
    # own files (the checkout, its .venv) may not be readable by the other user. grpc
    # imports its channel modules on first use: make one channel, and fail one wait on it.
    import grpc

    import lpsync_client.client

    with (
        grpc.insecure_channel("unix:/nonexistent/lpsync-warm-up.sock") as channel,
        contextlib.suppress(grpc.FutureTimeoutError),
    ):
        grpc.channel_ready_future(channel).result(timeout=0.01)

    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    assert os.getuid() == uid and os.geteuid() == uid
    got: dict[str, str] = {}
    try:
        with lpsync_client.client.Client(
            socket=sock, job=f"uid{uid}", rank=0, world_size=1, timeout=10, connect_timeout=5, trigger="grpc"
        ) as c:
            x = c.zeros(4, "float32")
            x[:] = 2
            c.allreduce(x)
            got["grpc"] = "ok" if np.all(x == 2) else f"wrong result {x}"
    except lpsync_client.LpsyncError as error:
        got["grpc"] = f"{type(error).__name__}: {error}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.connect(trigger)
            got["trigger"] = "ok"
        except OSError as error:
            got["trigger"] = f"{errno.errorcode.get(error.errno, error.errno)}"
    try:
        fd = os.open(os.path.join("/dev/shm", shm), os.O_RDONLY)
        os.close(fd)
        got["shm"] = "ok"
    except OSError as error:
        got["shm"] = f"{errno.errorcode.get(error.errno, error.errno)}"
    return got


def allreduces(rank: int, sockets: list[str], per_node: int, job: str, world: int, count: int) -> list[bool]:
    """``count`` allreduces of a multi-node job, each checked against its expected sum."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    ok = []
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=60
    ) as c:
        x = c.zeros(50_000, "int64")
        for i in range(count):
            x[:] = rank * 100 + i
            c.allreduce(x)
            ok.append(bool(np.all(x == sum(r * 100 + i for r in range(world)))))
    return ok


def ucx_garbage(target_port: int, own_port: int, sizes: list[int]) -> list[str]:
    """Speak UCX to a daemon's peer port but send random bytes where the handshake's hello
    belongs, one connection per size; what each connection ended with."""
    import time

    from lpsync.transport.addresses import parse_peers
    from lpsync.transport.ucx import RuntimeOptions, UcxEndpoint, UcxOptions, UcxRuntime

    peers = tuple(parse_peers(f"127.0.0.1:{target_port},127.0.0.1:{own_port}"))
    runtime = UcxRuntime(RuntimeOptions(own_port, "tcp"))
    # The endpoint's own connection and stream helpers, minus the handshake.
    endpoint = UcxEndpoint(UcxOptions(1, peers, b"unused", handshake_timeout=5.0))
    endpoint._runtime = runtime
    outcomes = []
    try:
        for size in sizes:
            ep = endpoint._create_ep("127.0.0.1", target_port, 5.0)
            send, recv = endpoint._stream_io(ep, time.monotonic() + 5.0)
            try:
                send(os.urandom(size))
                recv(1)
                outcomes.append("answered")
            except Exception as error:
                outcomes.append(type(error).__name__)
            finally:
                endpoint._close_ep(ep)
    finally:
        time.sleep(0.5)  # the closes posted above run first
        runtime.close()
    return outcomes
