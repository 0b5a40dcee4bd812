"""Armed plans across nodes, with real daemons meshed over loopback TCP and real rank
processes: repeated collectives of every op on the same buffers run armed from their third
call (the first connects the engine's channels, the second arms), bitwise as on the
general path and against numpy; and what fails while ranks ring the doorbell across nodes
(a rank that calls another collective, a daemon that is killed) fails with the error table's
errors on every rank, in seconds, nothing left behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lpsync.native import engine as native_engine
from tests.collective_cases import check_case_results, rotating_cases
from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.native import workers

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
KINDS = [("float32", "sum"), ("int32", "max"), ("float64", "avg"), ("int64", "prod"), ("bfloat16", "min")]


def _cluster(tmp: Path, native: str, nodes: int = NODES) -> PeeredDaemons:
    tmp.mkdir(parents=True, exist_ok=True)
    return PeeredDaemons(
        tmp, nodes, "--peer-transport", "tcp", "--native", native, "--heartbeat-timeout", "3"
    )


@pytest.mark.parametrize(("count", "repeats"), [(29, 4), (20_011, 14)], ids=["small", "pipelined"])
def test_repeated_collectives_run_armed_and_match_numpy(tmp_path: Path, count: int, repeats: int) -> None:
    """Small ones (riding the agreement on the general path) arm at their second call;
    pipelined ones once node 0 has timed its candidate schedules (learning.py). Their
    float bits may differ from the general path's: a small one rides the agreement's
    tree there, and node 0 may keep another schedule in another run; numpy judges."""
    assert native_engine() is not None, "the native engine is not built (the install builds it)"
    cases = rotating_cases(WORLD, count, KINDS, root=1, seed=count)
    cluster = _cluster(tmp_path, "on")
    try:
        sockets = [str(d.socket) for d in cluster.daemons if d is not None]
        ranks = run_ranks(
            WORLD, workers.run_cases_on_nodes, sockets, PER_NODE, WORLD, cases, repeats, timeout=300
        )
    finally:
        unclean = cluster.stop()
    assert not unclean, unclean
    check_case_results(cases, [r[0] for r in ranks], WORLD, inputs_kept=True)
    infos = [ranks[node * PER_NODE][1] for node in range(NODES)]
    answered = [i["answered"] - i["fallbacks"] for i in infos]  # run by the engine
    # From the third call of a small case on; a pipelined one once its trials end.
    least = (repeats - 2) * len(cases) if count < 1000 else len(cases)
    assert all(a >= least for a in answered), (answered, len(cases))


def test_another_collective_on_one_node_fails_every_rank_as_a_mismatch_in_seconds(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "on")
    try:
        sockets = [str(d.socket) for d in cluster.daemons if d is not None]
        began = time.monotonic()
        reports = run_ranks(2, workers.repeat_then_on_nodes, sockets, 1, 2, "mm", "mismatch", timeout=120)
    finally:
        unclean = cluster.stop()
    assert not unclean, unclean
    for r in reports:
        assert r["armed"], r
        name, code, message = r["error"]
        assert (name, code) == ("MismatchError", "INVALID_ARGUMENT"), r
        assert "count" in message, message
        assert r["seconds"] < 10, r
    assert time.monotonic() - began < 90


def test_a_rank_that_dies_fails_the_armed_call_on_every_node_at_once(tmp_path: Path) -> None:
    """Rank 1 (node 0) exits while the others ring: node 0 fails the call (ABORTED) and,
    before it answers rank 0 (whose detach may end the job and close its channels),
    sends a NOTICE on the GO round, so node 1's ranks, waiting on it in their engine,
    fall back and hear the same error, within seconds, not their 30 s timeout (the
    chaos run's killed trainer)."""
    cluster = _cluster(tmp_path, "on")
    try:
        sockets = [str(d.socket) for d in cluster.daemons if d is not None]
        reports = run_ranks(
            WORLD,
            workers.repeat_then_on_nodes,
            sockets,
            PER_NODE,
            WORLD,
            "dies",
            "die",
            dies=(1,),
            timeout=120,
        )
    finally:
        unclean = cluster.stop()
    assert not unclean, unclean
    for rank in (0, 2, 3):
        r = reports[rank]
        assert r["armed"], r
        name, code, message = r["error"]
        assert (name, code) == ("AbortedError", "ABORTED"), r
        assert "rank(s) 1" in message or "rank 1 of job 'dies' left" in message, message
        # Rank 1 dies 0.5 s in; the others hear it in about the heartbeat bound (3 s), far
        # from their 30 s timeout (the margin: a loaded 2-core CI machine).
        assert r["seconds"] < 0.5 + 3.0 + 6.0, r


def test_asynchronous_calls_ring_too_in_order_with_blocking_and_new_ones(tmp_path: Path) -> None:
    """A comm hook's shape (two asynchronous allreduces in flight), blocking calls and
    calls seen once between them: all correct, and the repeated ones run armed."""
    cluster = _cluster(tmp_path, "on")
    try:
        sockets = [str(d.socket) for d in cluster.daemons if d is not None]
        reports = run_ranks(WORLD, workers.async_mix, sockets, PER_NODE, WORLD, 60, timeout=300)
    finally:
        unclean = cluster.stop()
    assert not unclean, unclean
    assert [r["wrong"] for r in reports] == [0] * WORLD, reports
    # Each rank's own daemon counts its job's engine runs: most of the 2 x 60 + 9 repeats.
    assert all(r["answered"] >= 60 for r in reports), reports
