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


# The files that take longest (`make test` prints the slowest tests), started first: under
# `--dist loadfile` a long file begun near the end sets the suite's wall time by itself.
SLOWEST_FIRST = (
    "tests/cluster/test_chaos.py",
    "tests/test_paper.py",
    "tests/torch_suite/test_torch_suite.py",
    "tests/training/test_demo.py",
    "tests/daemon/test_daemon_multinode.py",
    "tests/daemon/test_hostile_peers.py",
    "tests/deploy/test_prometheus.py",
    "tests/daemon/test_responsive.py",
    "tests/training/test_examples.py",
    "tests/client/torch_backend/test_backend_errors.py",
    "tests/daemon/test_partitions.py",
    "tests/daemon/test_daemon_devices.py",
    "tests/cluster/test_cluster_bench.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(Path(item.path).resolve().relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order
