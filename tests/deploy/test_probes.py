"""`lpsync health`, the exec probe of the deploy/ manifests, against real daemons; and
the metric helpers the alerts and the dashboard rely on."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from lpsync.daemon.control.metrics import _BUCKETS, size_class
from tests.daemon.harness import ROOT, DaemonProcess


def _health(socket: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "health", "--socket", socket, "--timeout", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_health_passes_for_a_serving_daemon_even_with_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = DaemonProcess(tmp_path, "--token-file", str(token))
    try:
        done = _health(daemon.socket)
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout
        # The token is enforced elsewhere: status without it is refused.
        status = subprocess.run(
            [sys.executable, "-m", "lpsync.cli", "status", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert status.returncode != 0 and "token" in status.stderr
    finally:
        daemon.stop_and_check()
    done = _health(daemon.socket)  # stopped: the probe fails, and says why
    assert done.returncode == 1 and "unreachable" in done.stderr


def test_health_fails_on_a_socket_nobody_serves(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:  # a socket file whose listener is gone
        s.bind(str(stale))
    done = _health(str(stale))
    assert done.returncode == 1 and "unreachable" in done.stderr


def test_size_classes_and_buckets() -> None:
    assert [size_class(n) for n in (0, 4096, 4097, 1 << 20, (1 << 20) + 1, 1 << 40)] == [
        "<=4KiB",
        "<=4KiB",
        "<=64KiB",
        "<=1MiB",
        "<=16MiB",
        ">4GiB",
    ]
    assert _BUCKETS[0] == 1e-5 and _BUCKETS[-1] >= 600
    assert list(_BUCKETS) == sorted(set(_BUCKETS))
