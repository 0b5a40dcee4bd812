"""Every local and network security surface of the daemon, end to end (docs/security.md):
another uid against both sockets and the shared memory, the TCP listener's start-up
checks, the token on every RPC, and the cluster secret kept out of logs, status and
metrics."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import lpsync_client
from lpsync.daemon import launch
from lpsync_client.wire.proto import lpsync_pb2 as pb
from tests.daemon.harness import ROOT, DaemonProcess, cli_status, helper_context, run_ranks, shm_segments
from tests.daemon.security_workers import allreduces, as_user
from tests.ports import free_ports

NOBODY = 65534


def _spawn(target, *args, timeout: float = 60.0):
    ctx = helper_context()
    with ctx.Pool(1) as pool:
        return pool.apply_async(target, args).get(timeout)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may traverse: only the sockets' own modes decide who gets in
    (pytest's tmp_path is 0700 and would refuse other users by itself)."""
    where = Path(tempfile.mkdtemp(prefix="lpsync-sec-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_reaches_neither_socket_nor_shared_memory(open_dir: Path) -> None:
    d = DaemonProcess(open_dir)
    try:
        trigger = d.socket + ".trigger"
        with lpsync_client.connect(d.socket, job="owner", rank=0, world_size=1) as c:
            c.zeros(1024, "float32")
            (segment,) = shm_segments(d.pid)
            for path in (d.socket, trigger, f"/dev/shm/{segment}"):
                st = os.stat(path)
                assert st.st_mode & 0o777 == 0o660, (path, oct(st.st_mode))
                assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), path
            start = time.monotonic()
            outsider = _spawn(as_user, NOBODY, NOBODY, [], d.socket, trigger, segment)
            refused_in = time.monotonic() - start
            # Control: the same user in the sockets' group gets in everywhere, so the
            # refusals above come from the modes, not from anything else in the way.
            member = _spawn(as_user, NOBODY, NOBODY, [os.getgid()], d.socket, trigger, segment)
        assert outsider["grpc"].startswith("UnavailableError"), outsider
        assert "permission denied" in outsider["grpc"], outsider
        assert outsider["trigger"] == "EACCES" and outsider["shm"] == "EACCES", outsider
        assert refused_in < 30, refused_in
        assert member == {"grpc": "ok", "trigger": "ok", "shm": "ok"}, member
    finally:
        d.stop_and_check()


def _methods() -> list[tuple[str, bool, bool]]:
    service = pb.DESCRIPTOR.services_by_name["LpSync"]
    return [
        (f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in service.methods
    ]


def _call(
    channel: grpc.Channel, method: str, client_streaming: bool, server_streaming: bool, metadata: tuple | None
) -> grpc.StatusCode:
    ident = bytes
    try:
        if client_streaming and server_streaming:
            for _ in channel.stream_stream(method, ident, ident)(iter([b""]), timeout=5, metadata=metadata):
                pass
        elif server_streaming:
            for _ in channel.unary_stream(method, ident, ident)(b"", timeout=5, metadata=metadata):
                pass
        else:
            channel.unary_unary(method, ident, ident)(b"", timeout=5, metadata=metadata)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_every_rpc_needs_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("the-right-token\n")
    d = DaemonProcess(tmp_path, "--token-file", str(token))
    try:
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            for method, cs, ss in _methods():
                for metadata in (
                    None,
                    (("authorization", "Bearer wrong"),),
                    (("authorization", "the-right-token"),),
                ):  # no "Bearer"
                    code = _call(channel, method, cs, ss, metadata)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, code)
            # Health answers without credentials (probes) and reveals nothing else.
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Control: with the token the same channel is served.
            code = _call(
                channel,
                f"/{pb.DESCRIPTOR.services_by_name['LpSync'].full_name}/Status",
                False,
                False,
                (("authorization", "Bearer the-right-token"),),
            )
            assert code == grpc.StatusCode.OK
        with pytest.raises(lpsync_client.UnauthenticatedError):
            lpsync_client.connect(d.socket, job="t", rank=0, world_size=1)  # no token at all
    finally:
        d.stop_and_check()


@pytest.mark.parametrize(
    "given", [("listen",), ("listen", "cert", "key"), ("listen", "token"), ("listen", "cert", "token")]
)
def test_tcp_listener_without_tls_and_token_is_refused_at_start(
    tmp_path: Path, given: tuple[str, ...]
) -> None:
    (port,) = free_ports(1)
    files = {"cert": "--tls-cert", "key": "--tls-key", "token": "--token-file"}
    argv = ["--listen", f"127.0.0.1:{port}"]
    for name in given[1:]:
        (tmp_path / name).write_text("x")
        argv += [files[name], str(tmp_path / name)]
    sock = tmp_path / "d.sock"
    done = subprocess.run(
        launch.command(str(sock), *argv),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done
    assert "TLS" in done.stderr and "token" in done.stderr, done.stderr
    assert not sock.exists()


def test_the_cluster_secret_never_shows(tmp_path: Path) -> None:
    """Two daemons (the secret from the environment on one, from a file on the other), a
    third holding another secret that keeps dialling, a multi-node job, DEBUG logs and a
    stack dump: the secret is in no log, no status and no metric, in no common encoding."""
    secret = "Sq7-cluster-secret-" + os.urandom(8).hex()
    forms = [secret, secret.encode().hex(), base64.b64encode(secret.encode()).decode()]
    ports, metrics = free_ports(3), free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    daemons: list[DaemonProcess] = []
    try:
        for node in range(2):
            where = tmp_path / f"node{node}"
            where.mkdir()
            how = ["--secret-file", str(secret_file)] if node else []
            daemons.append(
                DaemonProcess(
                    where,
                    "--peers",
                    peers,
                    "--node-rank",
                    str(node),
                    "--metrics-port",
                    str(metrics[node]),
                    *how,
                    env={"LPSYNC_SECRET": secret} if node == 0 else {},
                    preforked=False,  # exec'd: its own command line is read below
                )
            )
        (tmp_path / "other").mkdir()
        other = DaemonProcess(
            tmp_path / "other",
            "--peers",
            f"127.0.0.1:{ports[0]},127.0.0.1:{ports[2]}",
            "--node-rank",
            "1",
            env={"LPSYNC_SECRET": "another-cluster"},
        )
        daemons.append(other)
        assert (
            run_ranks(2, allreduces, [d.socket for d in daemons[:2]], 1, "sec", 2, 3, timeout=120)
            == [[True] * 3] * 2
        )
        texts = []
        for node, d in enumerate(daemons[:2]):
            texts.append(cli_status(d.socket, "--json"))
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics[node]}/metrics", timeout=10) as page:
                texts.append(page.read().decode())
            texts.append(Path(f"/proc/{d.pid}/cmdline").read_bytes().decode(errors="replace"))
            d.proc.send_signal(signal.SIGUSR1)  # every thread's stack into the log
        time.sleep(0.5)
    finally:
        launch.stop_together(daemons)
    logs = [d.log.read_text() for d in daemons]
    assert "peer mesh up" in logs[0] and "lpsync_peers_connected" in texts[1], "nothing ran"
    assert "Thread" in logs[0], "no stack dump in the log"
    for text in texts + logs:
        for form in forms:
            assert form not in text, f"the secret ({form}) shows in:\n{text[:2000]}"


def test_a_refused_trigger_connection_is_logged_with_its_peer(daemon) -> None:
    from lpsync_client._trigger import TriggerStream

    with pytest.raises(lpsync_client.NotFoundError):
        TriggerStream(daemon.socket + ".trigger", "a-guessed-session-id", 5.0)
    deadline = time.monotonic() + 10
    while "refused a connection" not in (log := daemon.log.read_text()):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.1)
    line = next(x for x in log.splitlines() if "trigger socket: refused" in x)
    assert f"pid {os.getpid()} uid {os.getuid()}" in line, line
    assert "a-guessed-session-id" in line  # the NotFoundError names what was asked for
