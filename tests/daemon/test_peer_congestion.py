"""The tcp peer transport's congestion control (--peer-tcp-congestion): each daemon sets
its own on every peer connection, read back from the kernel (ss); the default, auto, keeps
the host's where the daemon may not set CUBIC (no CAP_NET_ADMIN, as in a container); a
name the host cannot give a socket stops the daemon at start, naming what it can."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lpsync.daemon.launch import DaemonStartError
from lpsync.transport.tcp import congestion
from tests.daemon.harness import DaemonProcess, PeeredDaemons, cli_status

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def _congestion_by_pid() -> dict[int, set[str]]:
    """The congestion control of every established TCP socket, by owning process (ss
    prints it among the socket's options, after "ts" and "sack" where those are on)."""
    names = set(congestion.AVAILABLE.read_text().split())
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    found: dict[int, set[str]] = {}
    pids: list[int] = []
    for line in out.splitlines():
        if "users:" in line:
            pids = [int(part.split(",")[0]) for part in line.split("pid=")[1:]]
        elif pids and line.strip():
            used = [token for token in line.split() if token in names]
            for pid in pids:
                found.setdefault(pid, set()).update(used[:1] or ["?"])
            pids = []
    return found


def test_each_daemon_sets_its_congestion_control_on_its_peer_connections(tmp_path: Path) -> None:
    cluster = PeeredDaemons(
        tmp_path, 2, "--peer-transport", "tcp", per_node=[(), ("--peer-tcp-congestion", "reno")]
    )
    try:
        pids = [d.pid for d in cluster.daemons if d is not None]
        deadline = time.monotonic() + 30
        seen = _congestion_by_pid()
        while not all(pid in seen for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # the mesh connects after the daemons serve
            seen = _congestion_by_pid()
        # Node 0 takes the default, whatever the host's is; node 1 what it was given.
        assert seen.get(pids[0]) == {"cubic"}, seen
        assert seen.get(pids[1]) == {"reno"}, seen
        assert "tcp_congestion" in cluster.log(1) and "reno" in cluster.log(1)
        # `lpsync status` says the same, and where it came from.
        host = congestion.host_default()
        shown = [json.loads(cli_status(socket, "--json"))["peer_plane"] for socket in cluster.sockets]
        assert [(p["tcp_congestion"], p["ucx_tls"]) for p in shown] == [("cubic", ""), ("reno", "")]
        said = f"--peer-tcp-congestion; the host's default is {host}"
        assert shown[1]["tcp_congestion_reason"] == said
        auto = f"auto: cubic whatever the host's default ({host})"
        assert f"peer sockets' TCP congestion control: cubic ({auto})" in cli_status(cluster.sockets[0])
        assert "UCX_TLS" not in cli_status(cluster.sockets[1])
    finally:
        cluster.stop_and_check()


NO_NET_ADMIN = ("setpriv", "--inh-caps", "-net_admin", "--bounding-set", "-net_admin", "--")


@pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("setpriv") is None
    or "cubic"
    in (
        congestion.HOST_DEFAULT.read_text(),
        *Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split(),
    ),
    reason="needs root and setpriv, and a host that allows cubic only to CAP_NET_ADMIN",
)
def test_auto_keeps_the_hosts_default_where_the_daemon_may_not_set_cubic(tmp_path: Path) -> None:
    # Node 1 runs as a container would: root without CAP_NET_ADMIN. It must still start,
    # run the host's default on its own connections, and say why; node 0 runs CUBIC.
    cluster = PeeredDaemons(tmp_path, 2, "--peer-transport", "tcp", wrap_of=[(), NO_NET_ADMIN])
    try:
        pids = [d.pid for d in cluster.daemons if d is not None]
        deadline = time.monotonic() + 30
        seen = _congestion_by_pid()
        while not all(pid in seen for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = _congestion_by_pid()
        host = congestion.host_default()
        assert seen.get(pids[0]) == {"cubic"}, seen
        assert seen.get(pids[1]) == {host}, seen
        shown = json.loads(cli_status(cluster.sockets[1], "--json"))["peer_plane"]
        assert shown["tcp_congestion"] == host, shown
        reason = shown["tcp_congestion_reason"]
        assert reason.startswith("auto: the host's default, since this process may not set cubic"), reason
        assert "CAP_NET_ADMIN" in reason and "tcp_allowed_congestion_control" in reason, reason
        assert '"level": "warning"' in cluster.log(1) and "may not set cubic" in cluster.log(1)
    finally:
        cluster.stop_and_check()


def test_a_congestion_control_the_host_lacks_stops_the_daemon(tmp_path: Path) -> None:
    with pytest.raises(DaemonStartError) as refused:
        DaemonProcess(
            tmp_path,
            "--peers",
            "127.0.0.1:1,127.0.0.1:2",
            "--node-rank",
            "0",
            "--peer-transport",
            "tcp",
            "--peer-tcp-congestion",
            "no-such-algorithm",
            env={"LPSYNC_SECRET": "congestion-test"},
        )
    message = str(refused.value)
    assert "exited (1)" in message and "peer_tcp_congestion 'no-such-algorithm'" in message, message
    assert "available:" in message and "cubic" in message, message
