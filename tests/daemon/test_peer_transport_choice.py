"""``--peer-transport auto`` (the default): UCX where the node has an RDMA device, the TCP
backend elsewhere; the daemon says which it chose and why, and a cluster on the default
forms its mesh and runs collectives. The device path (how device chunks cross the peer
plane, lpsync/transport/ucx/device_support.py) is logged and shown by `lpsync status`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lpsync.transport import backends
from tests.daemon.harness import ROOT, DaemonProcess, PeeredDaemons, cli_status, run_ranks
from tests.daemon.multinode_workers import one_allreduce


def _choice(log: str, msg: str = "peers") -> dict:
    for line in log.splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("msg") == msg:
            return entry
    raise AssertionError(f"no {msg!r} line in the log:\n{log[-2000:]}")


def test_the_default_transport_is_chosen_by_the_node_and_said(tmp_path: Path) -> None:
    expected = "ucx" if backends.rdma_devices() else "tcp"
    cluster = PeeredDaemons(tmp_path, 2)
    try:
        for node in range(2):
            entry = _choice(cluster.log(node))
            assert entry["peer_transport"] == expected, entry
            assert entry["why"].startswith("auto: "), entry
        values = run_ranks(2, one_allreduce, cluster.sockets, 1, "auto-transport", 2, timeout=60)
        assert values == [1 + 2, 1 + 2]  # every element is the sum of rank + 1 over both ranks
    finally:
        cluster.stop_and_check()


def test_status_shows_the_peer_transport_and_the_device_path(tmp_path: Path) -> None:
    expected = "ucx" if backends.rdma_devices() else "tcp"
    cluster = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2")
    try:
        peer = json.loads(cli_status(cluster.sockets[0], "--json"))["peer_plane"]
        assert peer["transport"] == expected, peer
        assert peer["transport_reason"].startswith("auto: "), peer
        assert peer["device_path"] == "staged", peer
        assert peer["device_reason"].startswith("emulated devices are host memory UCX cannot address"), peer
        assert (peer["device_transports"], peer["gpudirect_rdma"]) == ([], False)
        if expected == "tcp":  # its own sockets' congestion control; UCX's are UCX's
            assert peer["tcp_congestion"] and not peer["ucx_tls_reason"], peer
        else:
            assert peer["ucx_tls_reason"].startswith("auto: ") and not peer["tcp_congestion"], peer
        logged = _choice(cluster.log(0), "peer device path")
        assert (logged["device_path"], logged["why"]) == ("staged", peer["device_reason"])
        text = cli_status(cluster.sockets[1])
        assert f"peer transport: {expected} (auto: " in text
        assert "peer device path: staged (emulated devices are host memory" in text
    finally:
        cluster.stop_and_check()
    (tmp_path / "single").mkdir()
    single = DaemonProcess(tmp_path / "single")
    try:
        assert json.loads(cli_status(single.socket, "--json"))["peer_plane"]["transport"] == ""
        assert "peer plane: none (a single node)" in cli_status(single.socket)
    finally:
        single.stop_and_check()


def test_a_device_path_that_cannot_be_had_refuses_to_start(tmp_path: Path) -> None:
    """--peer-device-path device on a daemon without devices: it says why and exits,
    instead of staging behind the operator's back."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "daemon",
            "--socket",
            str(tmp_path / "d.sock"),
            "--peers",
            "127.0.0.1:1,127.0.0.1:2",
            "--node-rank",
            "0",
            "--peer-transport",
            "tcp",
            "--peer-device-path",
            "device",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "LPSYNC_SECRET": "s"},
    )
    assert done.returncode != 0
    assert "--peer-device-path device is not possible here: the daemon serves no devices" in done.stderr
    assert not (tmp_path / "d.sock").exists()
