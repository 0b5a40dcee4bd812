"""Training through lpsync: real daemons (tests/daemon/harness.py), real trainer processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from harness import DaemonProcess

pytest.importorskip("torch")


@pytest.fixture
def daemon(tmp_path: Path):
    """One daemon on a Unix socket in tmp_path; stopped (and checked for leaks) afterwards."""
    proc = DaemonProcess(tmp_path)
    try:
        yield proc
    finally:
        proc.stop_and_check()
