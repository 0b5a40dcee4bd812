"""gather, scatter and alltoall through real daemons and client processes, against numpy
(tests/daemon/workers.py: every rank checks its own result bit for bit): one daemon with
three ranks (the direct path, and the schedules above it), and three daemons on loopback
peers with two ranks each (small ones riding the agreement, large ones as schedules)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.multinode_workers import cases_on_nodes
from tests.daemon.workers import check_cases

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8"]
OPS = ("gather", "scatter", "alltoall")


def _cases(world: int, big: int) -> list[tuple]:
    """(op, dtype, reduce op, count, in place, algorithm, root, shared memory) tuples."""
    cases = []
    for (op, dt), in_place in itertools.product(itertools.product(OPS, DTYPES), (False, True)):
        if op == "alltoall" and in_place:
            continue  # out of place only
        root = world - 1 if dt.startswith("float") else 1
        cases.append((op, dt, "sum", 5, in_place, None, root, True))
    for op in OPS:  # above the direct path / the agreement: the schedules
        for in_place in (False,) if op == "alltoall" else (False, True):
            cases.append((op, "float32", "sum", big, in_place, None, 0, True))
        cases.append((op, "int64", "sum", 9, False, None, 1, False))  # plain numpy: staged
    cases.append(("gather", "int32", "sum", 1000, False, "linear", 2, True))  # forced
    cases.append(("alltoall", "uint8", "sum", 0, False, "pairwise", 0, True))  # empty
    return cases


def _check(results: list[list[str]]) -> None:
    failures = [f for r in results for f in r if not f.startswith("digest:")]
    assert not failures, "\n".join(failures[:30])


def test_one_daemon_three_ranks(daemon) -> None:
    # 250_000 float32 blocks: 3 MB per rank's buffer, above the 2 MiB direct path.
    _check(run_ranks(3, check_cases, daemon.socket, "moves", 3, _cases(3, 250_000)))


@pytest.mark.parametrize("transport", ["tcp"])
def test_three_daemons_two_ranks_each(tmp_path: Path, transport: str) -> None:
    nodes, per_node = 3, 2
    cluster = PeeredDaemons(tmp_path, nodes, "--peer-transport", transport)
    try:
        world = nodes * per_node
        # 20_000 float32 blocks: 480 KB per buffer, above the 64 KiB that rides the agreement.
        cases = _cases(world, 20_000)
        _check(
            run_ranks(world, cases_on_nodes, cluster.sockets, per_node, "moves-mn", world, cases, timeout=120)
        )
    finally:
        unclean = cluster.stop()
    assert not unclean, "\n".join(unclean)


def test_bad_requests_fail_at_once(daemon) -> None:
    """alltoall in place, a non-root scatter's input of the wrong size and a root out of
    range are refused with the reason, and the job goes on."""
    from tests.daemon.workers import bad_data_movement

    got = run_ranks(2, bad_data_movement, daemon.socket, "moves-bad")
    for rank, messages in enumerate(got):
        assert "out of place" in messages[0], (rank, messages)
        assert "root 5" in messages[1], (rank, messages)
        assert messages[2] == "ok", (rank, messages)
