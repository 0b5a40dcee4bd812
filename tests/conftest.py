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
    "tests/daemon/test_daemon_multinode.py",  # 154 s
    "tests/training/test_examples.py",  # 115 s
    "tests/daemon/test_daemon_devices.py",  # 114 s
    "tests/training/test_torch_training.py",  # 102 s
    "tests/test_paper.py",  # 87 s
    "tests/transport/test_peer_transports.py",  # 85 s
    "tests/daemon/test_partitions.py",  # 71 s
    "tests/cluster/test_chaos.py",  # 70 s
    "tests/training/test_demo.py",  # 59 s
    "tests/bench/test_bench_models.py",  # 55 s
    "tests/daemon/test_security.py",  # 54 s
    "tests/cluster/test_cluster_bench.py",  # 49 s
    "tests/daemon/test_overload.py",  # 49 s
    "tests/daemon/test_daemon_errors.py",  # 49 s
    "tests/torch_suite/test_torch_suite.py",  # 48 s
    "tests/client/torch_backend/test_backend_errors.py",  # 47 s
    "tests/cluster/test_clean_exits.py",  # 47 s
    "tests/deploy/test_prometheus.py",  # 46 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(Path(item.path).resolve().relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order
