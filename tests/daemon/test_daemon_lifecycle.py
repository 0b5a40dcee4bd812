"""Shutdown, codegen freshness, reflection and health, status, metrics, config."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import lpsync_client
from lpsync.daemon import launch
from lpsync.daemon.control import server
from lpsync.daemon.control.config import load
from lpsync.errors import InvalidArgumentError
from lpsync.transport.ports import free_ports
from tests.daemon.harness import ROOT, DaemonProcess, shm_segments


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate = runpy.run_path(str(ROOT / "protos" / "generate.py"), run_name="lpsync_protos_generate")
    committed = generate["TARGET"]
    fresh = generate["generate"](tmp_path / "proto")
    for path in fresh:
        old = committed / path.name
        assert old.exists() and old.read_text() == path.read_text(), (
            f"{old} is stale: run python protos/generate.py"
        )
    # One copy, and nothing beside it that the generator no longer writes.
    assert {p.name for p in committed.iterdir() if p.is_file()} == {p.name for p in fresh}
    assert not (ROOT / "lpsync" / "_proto").exists()


def test_reflection_lists_services(daemon) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"lpsync.v1.LpSync", "grpc.health.v1.Health"} <= services


def test_start_up_objects_are_frozen_out_of_the_collector(daemon) -> None:
    """What start-up made lives as long as the daemon: it is frozen (gc.freeze) before
    serving, so that a full collection, which would otherwise scan it all (~23 ms), does
    not land in the first collectives (the bench's first point read low because of it)."""
    assert daemon.log is not None
    deadline = time.monotonic() + 10  # health answers SERVING a moment before the line
    while True:
        lines = [json.loads(line) for line in daemon.log.read_text().splitlines() if line.startswith("{")]
        serving = [line for line in lines if line["msg"] == "daemon serving"]
        if serving or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(serving) == 1, lines
    assert serving[0]["frozen_objects"] > 10_000, serving[0]


def test_sigterm_drains_and_cleans_up(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    clients = [lpsync_client.connect(d.socket, job="sd", rank=r, world_size=3, timeout=60) for r in range(2)]
    arrays = [c.zeros(1 << 16) for c in clients]
    staged = clients[0].register(np.ones(10))
    assert len(shm_segments(d.pid)) == 3 and staged.handle
    # Rank 2 never comes: both wait in a collective when the daemon is told to stop.
    futures = [c.allreduce_async(a) for c, a in zip(clients, arrays, strict=True)]
    time.sleep(0.2)
    start = time.monotonic()
    rc = d.stop()
    assert rc == 0 and time.monotonic() - start < 10
    for future in futures:
        with pytest.raises(lpsync_client.LpsyncError):
            future.result(timeout=5)
    assert shm_segments(d.pid) == []
    assert not Path(d.socket).exists()
    for c in clients:
        c.close()  # the daemon is gone: close still returns
    assert threading.active_count() < 20


def test_a_repeated_sigterm_still_exits_cleanly(tmp_path: Path) -> None:
    """A supervisor or a script may send SIGTERM more than once: one every 0.5 ms until
    the daemon is gone, with a session attached. Each one lands during the drain, or after
    it (where the default action would kill it: -15)."""
    d = DaemonProcess(tmp_path)
    client = lpsync_client.connect(d.socket, job="again", rank=0, world_size=1, timeout=10)
    client.allreduce(client.zeros(16))
    sent = 0
    while d.alive() and sent < 40000:  # 20 s
        d.proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.0005)
    rc = d.wait_stopped(10)
    client.close()
    assert sent > 1 and rc == 0, (sent, rc, d.tail())
    assert shm_segments(d.pid) == []
    assert not Path(d.socket).exists()


def test_stop_signals_go_from_stopping_the_daemon_to_ignored_without_the_default_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon's SIGTERM and SIGINT (server._catch_stop_signals): a signal landing on
    another thread wakes the loop and asks it to stop; once stopped they are ignored, and
    never does SIGTERM fall back to its default action on the way (CI once saw a second
    SIGTERM kill a daemon that had stopped cleanly: asyncio puts SIG_DFL back when it
    drops a handler)."""
    set_to: list[object] = []
    real_signal = signal.signal

    def recording(signum, handler):
        if signum == signal.SIGTERM:
            set_to.append(handler)
        return real_signal(signum, handler)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(signal, "signal", recording)
    stops: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        ignore = server._catch_stop_signals(loop, lambda: (stops.append("stop"), stopped.set()))
        # From another thread, as a signal may land on any thread of the daemon.
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        await asyncio.wait_for(stopped.wait(), 5)
        ignore()
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test process lives on
        await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert stops == ["stop"]
        assert signal.SIG_DFL not in set_to, set_to
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            real_signal(signum, handler)


def test_stop_together_kills_a_daemon_that_does_not_exit_and_reports_it(tmp_path: Path) -> None:
    """launch.stop_together: every daemon gets its SIGTERM first; one that does not exit
    within the bound (frozen here) is killed and reported, the others exit cleanly."""
    daemons = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        daemons.append(DaemonProcess(tmp_path / name))
    daemons[1].proc.send_signal(signal.SIGSTOP)
    codes = launch.stop_together(daemons, timeout=2.0)
    assert codes[0] == 0, daemons[0].tail()
    assert isinstance(codes[1], str) and codes[1].startswith("TimeoutExpired"), codes
    assert not daemons[0].alive() and not daemons[1].alive()
    assert shm_segments(daemons[0].pid) == []


_LAUNCHER = """
import os, sys, time
from pathlib import Path
import lpsync_client
from lpsync.demo.local_cluster import LocalCluster
cluster = LocalCluster(Path(sys.argv[1]), 2, ("--peer-transport", "tcp"))
client = lpsync_client.connect(cluster.nodes[0].socket, job="orphan", rank=0, world_size=1)
client.allreduce(client.zeros(1024))  # a session and a buffer (a shared memory segment)
child = os.fork() if sys.argv[2] == "fork" else -1  # a worker forked from the launcher
if child == 0:
    time.sleep(600)
    os._exit(0)
nodes = cluster.nodes
print(child, *(node.daemon.pid for node in nodes), *(node.socket for node in nodes), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for whoever adopted it counts: it holds nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("forked", ["alone", "fork"])
def test_daemons_stop_when_their_launcher_is_killed(tmp_path: Path, forked: str) -> None:
    """A demo, benchmark or test killed outright (SIGKILL: no handler runs) used to leave
    its daemons running, their sockets and shared memory with them. launch.Daemon gives
    each the read end of a pipe (--lifeline-fd) whose end stops it as SIGTERM does. A
    child forked from the launcher, still running, must not hold them up: it closed its
    copy of the write end at the fork."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path), forked], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = -1
    try:
        assert launcher.stdout is not None
        child_pid, first, second, *sockets = launcher.stdout.readline().split()
        child, pids = int(child_pid), [int(first), int(second)]
        assert all(not _gone(pid) for pid in pids) and shm_segments(pids[0])
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 20
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), [(pid, _gone(pid)) for pid in pids]
        assert child < 0 or not _gone(child)  # the forked child outlived them
    finally:
        launcher.kill()
        launcher.wait(10)
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    for pid, socket_path in zip(pids, sockets, strict=True):
        assert shm_segments(pid) == [], pid
        assert not Path(socket_path).exists() and not Path(socket_path + ".trigger").exists()
    log = (tmp_path / "node0.log").read_text()
    assert "the process that started this daemon is gone" in log, log[-2000:]


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_a_daemon_stopped_while_its_mesh_forms_exits_at_once_without_a_retry(
    tmp_path: Path, transport: str
) -> None:
    """Its peer never comes: SIGTERM closes the transport under the dial, which must end
    the attempts (the log said "peer mesh not up yet ...; retrying" as the daemon stopped)."""
    ports = free_ports(2)
    d = DaemonProcess(
        tmp_path,
        *("--peers", ",".join(f"127.0.0.1:{p}" for p in ports), "--node-rank", "0"),
        *("--peer-transport", transport),
        env={"LPSYNC_SECRET": "mesh-forming-stop"},
    )
    time.sleep(1.0)  # dialling its absent peer
    start = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - start < 5
    assert d.log is not None
    log = d.log.read_text()
    stopping = log.index("shutting down")
    assert "retrying" not in log[stopping:], log[stopping:]
    assert shm_segments(d.pid) == [] and not Path(d.socket).exists()


def test_a_lifeline_fd_that_is_not_open_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="lifeline_fd 987654 is not an open file descriptor"):
        load({"lifeline_fd": 987654}, {})


def test_stop_reaps_a_daemon_whose_wait_lock_an_interrupt_left_held(tmp_path: Path) -> None:
    """A Ctrl-C inside Popen.wait or poll, just after it took its lock, leaves the lock held
    (the demo saw it in CI): every later wait timed out on a daemon that had exited, so a
    stop cost its whole timeout and raised. launch.Daemon reaps without the lock."""
    d = DaemonProcess(tmp_path, preforked=False)  # this process's child, reaped by Popen
    assert d.proc._waitpid_lock.acquire(False)  # as the interrupted wait left it
    assert d.alive()
    start = time.monotonic()
    assert d.stop(timeout=15) == 0
    assert time.monotonic() - start < 10 and not d.alive()
    assert shm_segments(d.pid) == [] and not Path(d.socket).exists()


def test_status_and_metrics(tmp_path: Path) -> None:
    import socket as sk

    with sk.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProcess(tmp_path, "--metrics-port", str(port))
    try:
        with lpsync_client.connect(d.socket, job="st", rank=0, world_size=1) as c:
            x = c.zeros(256)
            for _ in range(3):
                c.allreduce(x)
            out = subprocess.run(
                [sys.executable, "-m", "lpsync.cli", "status", "--socket", d.socket, "--json"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=30,
                check=True,
            ).stdout
            status = json.loads(out)
            assert status["sessions"][0]["job"] == "st"
            assert status["buffers"][0]["nbytes"] == "1024"
            assert [r["op"] for r in status["recent"]][-3:] == ["allreduce"] * 3
            text = subprocess.run(
                [sys.executable, "-m", "lpsync.cli", "status", "--socket", d.socket],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=30,
                check=True,
            ).stdout
            assert "recent collectives" in text and "st" in text
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name in (
            "lpsync_collective_seconds_bucket",
            "lpsync_collective_bytes_total",
            "lpsync_busbw_bytes_per_second",
            "lpsync_sessions",
            "lpsync_registered_bytes",
            "lpsync_collective_errors_total",
        ):
            assert name in metrics, name
        assert 'lpsync_collective_bytes_total{op="allreduce"} 3072.0' in metrics
    finally:
        d.stop_and_check()


def test_config_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "lpsync.toml"
    toml.write_text('[daemon]\nsocket = "/from/toml"\nmetrics_port = 9000\ntimeout = 7.5\n')
    c = load({}, {}, str(toml))
    assert (c.socket, c.metrics_port, c.timeout) == ("/from/toml", 9000, 7.5)
    c = load({}, {"LPSYNC_SOCKET": "/from/env", "LPSYNC_METRICS_PORT": "9100"}, str(toml))
    assert (c.socket, c.metrics_port, c.timeout) == ("/from/env", 9100, 7.5)
    c = load({"socket": "/from/flag", "metrics_port": None}, {"LPSYNC_SOCKET": "/from/env"}, str(toml))
    assert (c.socket, c.metrics_port) == ("/from/flag", 9000)
    with pytest.raises(InvalidArgumentError):
        load({"listen": "0.0.0.0:7000"}, {}, None)  # TCP without TLS and token
    bad = tmp_path / "bad.toml"
    bad.write_text("nonsense = 1\n")
    with pytest.raises(InvalidArgumentError):
        load({}, {}, str(bad))


def test_listen_without_tls_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "daemon",
            "--socket",
            str(tmp_path / "s"),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert result.returncode == 2 and "TLS" in result.stderr


def test_tcp_with_tls_and_token(tmp_path: Path) -> None:
    import shutil
    import socket as sk

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert, token = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "token"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    token.write_text("tok")
    with sk.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProcess(
        tmp_path,
        "--listen",
        f"localhost:{port}",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--token-file",
        str(token),
    )
    try:
        with lpsync_client.connect(
            target=f"localhost:{port}",
            token="tok",
            root_certificates=cert.read_bytes(),
            job="tcp",
            rank=0,
            world_size=1,
        ) as c:
            x = c.zeros(4)
            x[:] = 2
            c.allreduce(x)
            assert x.tolist() == [2, 2, 2, 2]
        with pytest.raises(lpsync_client.UnauthenticatedError):
            lpsync_client.connect(
                target=f"localhost:{port}",
                token="bad",
                root_certificates=cert.read_bytes(),
                job="tcp",
                rank=0,
                world_size=1,
            )
    finally:
        d.stop_and_check()


def test_torch_tensor_and_buffer_protocol(daemon) -> None:
    torch = pytest.importorskip("torch")
    with lpsync_client.connect(daemon.socket, job="torch", rank=0, world_size=1) as c:
        t = torch.arange(6, dtype=torch.float32)
        h = c.register(t)
        assert c.allreduce(h, op="avg") is t
        assert t.tolist() == [0, 1, 2, 3, 4, 5]
        b = torch.ones(4, dtype=torch.bfloat16)
        c.allreduce(b)  # staged on the fly, bfloat16 bits as uint16
        assert b.tolist() == [1, 1, 1, 1]
        raw = bytearray(np.arange(4, dtype=np.int32).tobytes())
        c.broadcast(raw)
        assert np.frombuffer(raw, np.int32).tolist() == [0, 1, 2, 3]
        h.release()


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_sessions_leave_no_threads_behind(daemon) -> None:
    from tests.daemon.harness import run_ranks
    from tests.daemon.workers import isolated

    run_ranks(2, isolated, daemon.socket, "warm", 1)
    time.sleep(0.5)
    baseline = _threads(daemon.pid)
    for n in range(3):
        run_ranks(2, isolated, daemon.socket, f"t{n}", 1)
    with lpsync_client.connect(daemon.socket, job="big", rank=0, world_size=1) as c:
        c.allreduce(c.zeros(1 << 20), algorithm="lp")  # a pipelined group with its threads
    time.sleep(0.5)
    assert _threads(daemon.pid) <= baseline + 2, (baseline, _threads(daemon.pid))


def test_restart_after_sigkill_reclaims_shared_memory(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    c = lpsync_client.connect(d.socket, job="k", rank=0, world_size=1)
    c.zeros(1024)
    assert len(shm_segments(d.pid)) == 1
    d.proc.kill()  # no chance to clean up
    d.proc.wait(10)
    d._log.close()
    assert len(shm_segments(d.pid)) == 1
    with pytest.raises(lpsync_client.LpsyncError):
        c.allreduce(np.zeros(2), timeout=5)
    c.close()
    again = DaemonProcess(tmp_path)  # replaces the stale socket, unlinks the old segments
    try:
        assert shm_segments(d.pid) == []
        with lpsync_client.connect(again.socket, job="k", rank=0, world_size=1) as c2:
            c2.barrier()
    finally:
        again.stop_and_check()


class _DlpackOnly:
    """An object that offers only the DLPack protocol (no buffer protocol, not numpy)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_object_is_staged(daemon) -> None:
    backing = np.arange(5, dtype=np.int64)
    with lpsync_client.connect(daemon.socket, job="dl", rank=0, world_size=1) as c:
        h = c.register(_DlpackOnly(backing))
        c.allreduce(h, op="max")
        assert backing.tolist() == [0, 1, 2, 3, 4]
        assert h.staging.tolist() == [0, 1, 2, 3, 4]


def test_devices_setting_is_checked() -> None:
    for bad in ("gpu:0", "cuda:", "cuda:0,0", "emulated:0", "emulated:2,host=0-2", "emulated:2,fast=0-1"):
        with pytest.raises(InvalidArgumentError, match="--devices"):
            load({"devices": bad}, {}, None)
    for good in ("cpu:4", "cpu", "cuda:all", "cuda:0,1", "emulated:3,slow=0-2,host=1-2"):
        assert load({"devices": good}, {}, None).devices == good


def test_no_trigger_socket_falls_back_to_grpc(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, env={"LPSYNC_TRIGGER": "off"})
    try:
        assert not Path(d.socket + ".trigger").exists()
        with lpsync_client.connect(d.socket, job="nt", rank=0, world_size=1) as c:
            assert c.trigger == "grpc"
            c.allreduce(c.zeros(2))
        with pytest.raises(lpsync_client.UnavailableError):
            lpsync_client.connect(d.socket, job="nt2", rank=0, world_size=1, trigger="socket")
    finally:
        d.stop_and_check()


@pytest.mark.parametrize("preforked", [True, False])
def test_a_forked_daemon_ends_as_an_execd_one(tmp_path: Path, preforked: bool) -> None:
    """The suite's daemons fork from a preloaded zygote (tests/daemon/zygote.py): its
    daemon refuses a bad setting with the same exit code and log, stops on SIGTERM with
    0, reports a SIGKILL as one, and stops when its launcher's lifeline closes."""
    with pytest.raises(launch.DaemonStartError, match=r"exited \(2\) before serving:\n(.|\n)*--no-such-flag"):
        DaemonProcess(tmp_path, "--no-such-flag", preforked=preforked)
    d = DaemonProcess(tmp_path, preforked=preforked)
    assert isinstance(d.proc, subprocess.Popen) is not preforked
    assert d.stop() == 0 and not Path(d.socket).exists()
    d = DaemonProcess(tmp_path, preforked=preforked)
    d.proc.send_signal(signal.SIGKILL)
    assert d.wait_stopped(10) == -signal.SIGKILL
    d = DaemonProcess(tmp_path, preforked=preforked)
    d._forget_lifeline()  # as if this process had died: the daemon stops by itself
    assert d.wait_stopped(20) == 0, d.tail()
    assert shm_segments(d.pid) == [] and not Path(d.socket).exists()
