"""Fixtures shared by every test folder: a real daemon (tests/daemon/harness.py)."""

from __future__ import annotations

import itertools
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


# The order files start in under `make test` (--dist loadfile --no-loadscope-reorder): the
# files most of whose time is one or two long tests (summed per file over a whole run, 4
# workers on 2 cores, 2026-12-06) first, each beside one of the files with the most tests;
# then the rest, most tests first. pytest-xdist's own order (most tests first) started the
# one-test 67-s chaos file last, alone at the end (9 min 04 s that run); all the long
# files first ran four heavy torch files at once and each took 1.5x longer (9 min 18 s).
LONG_FEW = (
    "tests/cluster/test_chaos.py",  # 67 s, one test
    "tests/test_paper.py",  # 77 s, mostly one fixture
    "tests/torch_suite/test_torch_suite.py",  # 63 s, one test
    "tests/training/test_demo.py",  # 74 s, one test most of it
    "tests/training/test_examples.py",  # 145 s, 6 tests
    "tests/training/test_torch_training.py",  # 93 s
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
