"""Fixtures shared by every test folder: a real daemon (tests/daemon/harness.py)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from tests.daemon.harness import DaemonProcess

# One OpenMP thread in this process and every one it starts (set before torch is imported):
# torch's default of one per core spins its idle threads between ops, and four workers'
# trainers on two cores spun away ~1.2 CPU-s per training rank (measured on the DDP tests).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def daemon(tmp_path: Path):
    """A daemon on a Unix socket in tmp_path; stopped (and checked for leaks) afterwards."""
    proc = DaemonProcess(tmp_path)
    try:
        yield proc
    finally:
        proc.stop_and_check()


# The order files start in under `make test` (--dist loadfile --no-loadscope-reorder): the
# files most of whose time is one or two long tests first (their longest test's wall in a
# whole run of the suite, 2026-12-07 night), each beside one of the files with the most
# tests; then the rest, most tests first. pytest-xdist's own order (most tests first)
# started the one-test chaos file last, alone at the end; all the long files first ran
# four heavy torch files at once and each took 1.5x longer.
LONG_FEW = (
    "tests/training/test_examples.py",  # 6 tests under torchrun, the longest 49 s
    "tests/training/test_torch_training.py",  # 17 s
    "tests/test_paper.py",  # 122 s, its fixture
    "tests/training/test_demo.py",  # 79 s
    "tests/bench/test_bench_models.py",  # 43 s
    "tests/cluster/test_chaos.py",  # 51 s
    "tests/torch_suite/test_torch_suite.py",  # 75 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(Path(item.path).resolve().relative_to(root).as_posix(), []).append(item)
    long = [f for f in LONG_FEW if f in by_file]
    rest = sorted((f for f in by_file if f not in LONG_FEW), key=lambda f: -len(by_file[f]))
    order = [f for pair in itertools.zip_longest(long, rest) for f in pair if f is not None]
    items[:] = [item for f in order for item in by_file[f]]  # each file's tests keep their order
