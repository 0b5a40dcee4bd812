"""Fixtures shared by every test folder: a real daemon (tests/daemon/harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.harness import DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path):
    """A daemon on a Unix socket in tmp_path; stopped (and checked for leaks) afterwards."""
    proc = DaemonProcess(tmp_path)
    try:
        yield proc
    finally:
        proc.stop_and_check()
