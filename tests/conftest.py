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


# The files that take longest in all (`pytest --durations=0`, summed per file), started
# first: under `--dist loadfile` a long file begun near the end sets the suite's wall time
# by itself (longest first is the classic packing of jobs onto workers).
SLOWEST_FIRST = (
    "tests/training/test_examples.py",  # 106 s
    "tests/daemon/test_hierarchy.py",  # 99 s
    "tests/client/torch_backend/test_backend_training.py",  # 92 s
    "tests/daemon/test_daemon_multinode.py",  # 81 s
    "tests/torch_suite/test_torch_suite.py",  # 75 s
    "tests/training/test_torch_training.py",  # 73 s
    "tests/training/test_demo.py",  # 72 s
    "tests/test_paper.py",  # 72 s
    "tests/cluster/test_chaos.py",  # 69 s
    "tests/cluster/test_clean_exits.py",  # 61 s
    "tests/transport/test_peer_transports.py",  # 59 s
    "tests/daemon/test_partitions.py",  # 46 s
    "tests/daemon/test_daemon_devices.py",  # 44 s
    "tests/deploy/test_prometheus.py",  # 43 s
    "tests/cluster/test_cluster_bench.py",  # 39 s
    "tests/client/torch_backend/test_backend_errors.py",  # 37 s
    "tests/client/torch_backend/test_backend_ops.py",  # 37 s
    "tests/daemon/test_daemon_data_movement.py",  # 36 s
    "tests/client/torch_backend/test_backend_layout.py",  # 36 s
    "tests/daemon/test_overload.py",  # 35 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(Path(item.path).resolve().relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order
