"""The daemons know a job's layout: each meshed daemon tells its peers which ranks of a job
attached to it (peers/attached.py), and a job's first collectives wait until that settles
its layout (control/placing.py, judged by control/layout.placed). Real daemons meshed
over loopback TCP, real rank processes, results against numpy: four processes that say
only job/rank/world_size, the JAX adapter from the environment; and every contradiction
failing every rank within 10 s, naming the ranks and the nodes. The judgement and the
exchange first, without daemons."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

import lpsync_client
from lpsync.daemon.control.layout import Hinted, Unplaced, placed
from lpsync.daemon.peers import attached
from lpsync.daemon.peers.attached import REFUSAL_SECONDS, Attached, JobSeen
from lpsync.daemon.values import NodeLayout
from lpsync.errors import AbortedError, InvalidArgumentError
from lpsync.transport.tags import ATTACHED
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc
from tests.daemon.harness import PeeredDaemons, cli_status, run_ranks
from tests.daemon.layout_workers import jax_pytree, plain, plain_p2p

FAST = 10.0  # seconds: the bound for a contradiction, once it is knowable
STALL = 2.0  # the cluster's --stall-seconds


def _seen(nodes_of: dict[int, set[int]], world: int = 4, refused=None) -> JobSeen:
    daemons = {d for ds in nodes_of.values() for d in ds}
    return JobSeen({d: world for d in daemons}, nodes_of, refused or {})


# -- the judgement, no daemon ----------------------------------------------------------------


def test_the_layout_is_what_the_daemons_saw() -> None:
    seen = _seen({0: {0}, 1: {1}, 2: {0}, 3: {1}})
    assert placed("j", 4, 0, seen, None) == NodeLayout((0, 1, 0, 1), 0)
    assert placed("j", 4, 1, seen, None) == NodeLayout((0, 1, 0, 1), 1)
    # All on this node (whichever): a single-node job.
    assert placed("j", 2, 3, _seen({0: {3}, 1: {3}}, 2), None) is None
    # Daemons 2 and 5 are the job's nodes 0 and 1.
    assert placed("j", 2, 5, _seen({0: {2}, 1: {5}}, 2), None) == NodeLayout((0, 1), 1, (2, 5))
    # Not all attached yet: the others are named, and where the rest are.
    waiting = placed("j", 4, 0, _seen({0: {0}, 1: {0}}), None)
    assert waiting == Unplaced((2, 3), "node 0: ranks 0-1")
    # Hints that agree keep their layout.
    hinted = NodeLayout((0, 0, 1, 1), 0)
    said = Hinted(hinted, "LOCAL_WORLD_SIZE=2, LOCAL_RANK=0")
    assert placed("j", 4, 0, _seen({0: {0}, 1: {0}, 2: {1}, 3: {1}}), said) is hinted


@pytest.mark.parametrize(
    ("nodes_of", "hinted", "refused", "error", "words"),
    [
        pytest.param(
            {0: {0}, 1: {0, 1}},
            None,
            None,
            InvalidArgumentError,
            ["rank 1 on nodes 0, 1", "node 0: ranks 0-1; node 1: rank 1"],
            id="a-rank-on-two-nodes",
        ),
        pytest.param(
            {0: {0}, 1: {0}, 2: {1}},
            Hinted(None, "LOCAL_WORLD_SIZE=4, LOCAL_RANK=0"),
            None,
            InvalidArgumentError,
            [
                "LOCAL_WORLD_SIZE=4",
                "rank 2 attached to node 1, not node 0",
                "node 0: ranks 0-1; node 1: rank 2",
            ],
            id="hints-say-one-node",
        ),
        pytest.param(
            {0: {0}},
            None,
            {1: (1, "INVALID_ARGUMENT: bad hints")},
            AbortedError,
            ["rank 1 could not attach", "node 1 refused it: INVALID_ARGUMENT: bad hints"],
            id="a-rank-refused-elsewhere",
        ),
    ],
)
def test_a_contradiction_names_the_ranks_and_nodes(nodes_of, hinted, refused, error, words) -> None:
    with pytest.raises(error) as raised:
        placed("j", 4, 0, _seen(nodes_of, refused=refused), hinted)
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_world_sizes_that_differ_are_named() -> None:
    seen = JobSeen({0: 4, 1: 3}, {0: {0}, 1: {1}}, {})
    with pytest.raises(InvalidArgumentError, match=r"different world sizes \(node 0: 4; node 1: 3\)"):
        placed("j", 4, 0, seen, None)


class _Wire:
    """Two Attached tables joined by an in-memory peer plane: each note is delivered at
    once, in order, to the other's on_attached (or dropped while ``up`` is False)."""

    def __init__(self) -> None:
        self.up = True
        self.planes = [_Plane(self, n) for n in range(2)]
        self.tables = [Attached(p) for p in self.planes]  # type: ignore[arg-type]
        self.notes = 0

    def deliver(self, to: int, data: bytes) -> None:
        if self.up:
            self.notes += 1
            assert self.planes[to].on_attached is not None
            self.planes[to].on_attached(1 - to, data)


class _Plane:
    def __init__(self, wire: _Wire, rank: int) -> None:
        self.wire, self.rank, self.size = wire, rank, 2
        self.on_attached = self.on_mesh = None

    def note(self, peer: int, data: bytes, kind: int) -> None:
        assert kind == ATTACHED and len(data) <= 4096
        self.wire.deliver(peer, data)


def test_each_daemon_learns_where_the_ranks_of_a_job_are() -> None:
    wire = _Wire()
    a, b = wire.tables
    changed: list[str] = []
    b.listen(changed.append)
    a.attached("j", 4, 0)
    a.attached("j", 4, 1)
    b.attached("j", 4, 3)
    assert b.seen("j").nodes_of == {0: {0}, 1: {0}, 3: {1}} == a.seen("j").nodes_of
    assert changed == ["j"] * 3
    a.left("j", 1)
    assert b.seen("j").nodes_of == {0: {0}, 3: {1}}
    a.refused("j", 4, 2, "INVALID_ARGUMENT: why")
    assert b.seen("j").refused == {2: (0, "INVALID_ARGUMENT: why")}
    b.attached("j", 4, 2)  # attached after all: no longer refused
    assert a.seen("j").refused == {} and a.seen("j").nodes_of[2] == {1}


def test_a_new_mesh_sets_right_what_a_broken_one_lost() -> None:
    wire = _Wire()
    a, b = wire.tables
    a.attached("j", 2, 0)
    wire.up = False  # the mesh is down: a's notes are lost
    a.left("j", 0)
    a.attached("big", 1000, 0)
    for r in range(2, 1000, 2):  # 499 runs: told in several notes on the next mesh
        a.attached("big", 1000, r)
    assert b.seen("j").nodes_of == {0: {0}} and not b.seen("big").nodes_of
    wire.up = True
    assert wire.planes[0].on_mesh is not None
    wire.planes[0].on_mesh()
    assert b.seen("j").nodes_of == {}  # forgotten: a said it anew
    assert sorted(b.seen("big").nodes_of) == list(range(0, 1000, 2))
    assert wire.notes > 2  # the reset, then the runs in batches


def test_a_refusal_is_forgotten_after_a_while(monkeypatch) -> None:
    # A later run of a job of the same name must not fail for an old refusal.
    a, b = _Wire().tables
    a.refused("j", 2, 1, "INVALID_ARGUMENT: why")
    assert b.seen("j").refused == {1: (0, "INVALID_ARGUMENT: why")}
    later = time.monotonic() + REFUSAL_SECONDS + 1
    monkeypatch.setattr(attached, "time", SimpleNamespace(monotonic=lambda: later))
    assert b.seen("j").refused == {} and a.seen("j").refused == {}


# -- real daemons ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = PeeredDaemons(
        tmp_path_factory.mktemp("discovery"), 2, "--peer-transport", "tcp", "--stall-seconds", str(STALL)
    )
    try:
        deadline = time.monotonic() + 60  # the timings below are of collectives, not the mesh
        while not all("peer mesh up" in c.log(n) for n in range(2)) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield c
    except BaseException:
        c.stop()
        raise
    assert not (unclean := c.stop()), "\n".join(unclean)


def _two_per_node(c: PeeredDaemons) -> list[str]:
    return [c.sockets[0], c.sockets[0], c.sockets[1], c.sockets[1]]


def test_four_processes_with_no_hint_run_across_two_daemons(cluster: PeeredDaemons) -> None:
    # The run: connect(socket, job, rank, world_size), no store, no LOCAL_*; it
    # waited 300 s and failed DEADLINE_EXCEEDED on every rank before.
    results = run_ranks(4, plain, 4, _two_per_node(cluster), "armed", None, 200, timeout=180)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result}"
        assert result["node"] == rank // 2
        assert not result["failures"], f"rank {rank}: {result['failures']}"
    failed = [line for n in range(2) for line in cluster.log(n).splitlines() if '"collective failed"' in line]
    assert not [line for line in failed if '"armed"' in line], failed


def test_ranks_not_node_major_with_no_hint(cluster: PeeredDaemons) -> None:
    sockets = [cluster.sockets[n] for n in (1, 0, 0)]  # rank 0 alone on node 1
    results = run_ranks(3, plain, 3, sockets, "scattered", timeout=180)
    for rank, result in enumerate(results):
        assert "error" not in result and not result["failures"], f"rank {rank}: {result}"


def test_a_wrong_hint_fails_every_rank_fast_naming_it(cluster: PeeredDaemons) -> None:
    # LOCAL_WORLD_SIZE=4 says one node; the daemons saw two ranks on each.
    hints = [(r, 4) for r in range(4)]
    results = run_ranks(4, plain, 4, _two_per_node(cluster), "wrong-hint", hints, timeout=120)
    for rank, result in enumerate(results):
        assert result.get("code") == "INVALID_ARGUMENT", result
        assert "its hints (LOCAL_WORLD_SIZE=4, LOCAL_RANK=" in result["error"], result
        # Each daemon names a rank of the other node, attached there, not where the hint
        # puts it (as soon as it knows of one: the others may not have attached yet).
        other, mine = (1, 0) if rank < 2 else (0, 1)
        assert re.search(rf"rank \d attached to node {other}, not node {mine}", result["error"]), result
        assert "the daemons saw node 0: rank" in result["error"], result
        assert result["seconds"] < FAST, result


def _connect(socket: str, job: str, rank: int, world: int, **kw) -> lpsync_client.Client:
    return lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=60, **kw)


def _failure(future: Future, bound: float) -> lpsync_client.LpsyncError:
    """The error ``future`` ends with, within ``bound`` seconds."""
    with pytest.raises(lpsync_client.LpsyncError) as raised:
        future.result(timeout=bound)
    return raised.value


def test_a_rank_attached_to_two_nodes_fails_every_rank(cluster: PeeredDaemons) -> None:
    # Node 0 settles a one-node job of ranks 0 and 1; then a second rank 1 attaches to
    # node 1, which has no job of that name yet and takes it.
    node0, node1 = cluster.sockets
    clients = [_connect(node0, "twice", 0, 2), _connect(node0, "twice", 1, 2), _connect(node1, "twice", 1, 2)]
    try:
        time.sleep(0.5)  # known on every node once the last attach's note arrived
        started = time.monotonic()
        futures = [c.allreduce_async(c.zeros(8)) for c in clients]
        for future in futures:
            error = _failure(future, FAST)
            assert error.code == "INVALID_ARGUMENT", error
            assert "rank 1 on nodes 0, 1" in str(error) and "node 0: ranks 0-1; node 1: rank 1" in str(error)
        assert time.monotonic() - started < FAST
        # It stands until one of the two goes: then the job runs on.
        clients.pop().close()
        time.sleep(0.5)
        arrays = [c.zeros(4) for c in clients]
        for r, a in enumerate(arrays):
            a[:] = r + 1
        futures = [c.allreduce_async(a) for c, a in zip(clients, arrays, strict=True)]
        for future, a in zip(futures, arrays, strict=True):
            future.result(timeout=30)
            np.testing.assert_array_equal(a, np.full(4, 3.0, np.float32))
    finally:
        for c in clients:
            c.close()


def test_a_second_rank_of_a_settled_layout_is_refused_at_attach(cluster: PeeredDaemons) -> None:
    node0, node1 = cluster.sockets
    clients = [_connect(node1, "settled", 1, 2), _connect(node0, "settled", 0, 2)]
    try:
        # Node 0 knows rank 1 is node 1's: the job is two nodes, and another rank 1 here is
        # refused at once, naming both nodes; the job itself runs on.
        with pytest.raises(
            lpsync_client.InvalidArgumentError, match=r"rank 1 .* belongs to node 1, not to this node 0"
        ):
            _connect(node0, "settled", 1, 2)
        arrays = [c.zeros(4) for c in clients]
        for r, a in enumerate(arrays):
            a[:] = r + 1
        futures = [c.allreduce_async(a) for c, a in zip(clients, arrays, strict=True)]
        for future, a in zip(futures, arrays, strict=True):
            future.result(timeout=30)
            np.testing.assert_array_equal(a, np.full(4, 3.0, np.float32))
    finally:
        for c in clients:
            c.close()


def test_a_rank_that_never_attaches_fails_the_others_within_the_bound(cluster: PeeredDaemons) -> None:
    node0, node1 = cluster.sockets
    clients = [_connect(node0, "absent", 0, 3), _connect(node1, "absent", 1, 3)]
    try:
        started = time.monotonic()
        # The collectives' own timeout (300 s, the default) is not what they wait.
        futures = [c.allreduce_async(c.zeros(8), timeout=300) for c in clients]
        time.sleep(1.0)
        status = json.loads(cli_status(node0, "--json"))
        job = next(j for j in status["jobs"] if j["job"] == "absent")
        assert job["waiting"][0]["stage"] == "attaching" and job["waiting"][0]["missing_ranks"] == [2], job
        assert "ranks 2 not attached to any node yet" in cli_status(node0)
        for future in futures:
            error = _failure(future, 40)
            assert error.code == "DEADLINE_EXCEEDED", error
            assert "rank(s) 2 did not arrive: not attached to any daemon" in str(error), error
            assert "(attached: node 0: rank 0; node 1: rank 1)" in str(error), error
        assert time.monotonic() - started < 35
        # A shorter collective timeout bounds the wait instead.
        started = time.monotonic()
        error = _failure(clients[0].allreduce_async(clients[0].zeros(8), timeout=3), FAST)
        assert error.code == "DEADLINE_EXCEEDED" and 3 <= time.monotonic() - started < FAST, error
    finally:
        for c in clients:
            c.close()


def test_a_rank_refused_on_its_node_fails_the_others_at_once(cluster: PeeredDaemons) -> None:
    # Issue 46, item 6: a rank that gives up before attaching (here: its attach refused).
    node0, node1 = cluster.sockets
    with _connect(node0, "refused", 0, 2) as c:
        future = c.allreduce_async(c.zeros(8))
        time.sleep(1.0)  # parked, waiting for rank 1
        with grpc.insecure_channel(f"unix:{node1}") as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.LpSyncStub(channel).Attach(
                pb.AttachRequest(job="refused", rank=1, world_size=2, pid=1, rank_nodes=[0, 0]), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        started = time.monotonic()
        error = _failure(future, FAST)
        assert time.monotonic() - started < FAST
        assert error.code == "ABORTED", error
        assert "rank 1 could not attach (node 1 refused it: INVALID_ARGUMENT" in str(error), error
        # A later collective fails at once too, while the refusal stands.
        error = _failure(c.allreduce_async(c.zeros(8)), FAST)
        assert "rank 1 could not attach" in str(error), error


def test_a_stalled_rank_elsewhere_is_attached_to_its_node_not_missing(cluster: PeeredDaemons) -> None:
    node0, node1 = cluster.sockets
    clients = [_connect(node0, "stall", 0, 2), _connect(node1, "stall", 1, 2)]
    try:
        arrays = [c.zeros(4) for c in clients]
        arrays[0][:], arrays[1][:] = 1.0, 2.0
        future = clients[0].allreduce_async(arrays[0])  # rank 1 (node 1) comes late
        deadline = time.monotonic() + 30
        pattern = r"job 'stall' has waited .*: rank\(s\) 1 attached to node 1; node\(s\) 1 not heard from"
        while not re.search(pattern, cluster.log(0)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(pattern, cluster.log(0)), cluster.log(0)[-2000:]
        assert "ranks 1 attached to node(s) 1, not heard from" in cli_status(node0)
        clients[1].allreduce(arrays[1])
        future.result(timeout=30)
        for a in arrays:
            np.testing.assert_array_equal(a, np.full(4, 3.0, np.float32))
    finally:
        for c in clients:
            c.close()


def test_point_to_point_with_no_hint_across_two_daemons(cluster: PeeredDaemons) -> None:
    # A send's pair job takes its two ranks' nodes from its main job's settled layout.
    sockets = [cluster.sockets[n] for n in (0, 1, 1, 0)]
    results = run_ranks(4, plain_p2p, 4, sockets, "p2p-plain", timeout=180)
    assert results == [[], [], [], []], results


def test_the_jax_adapter_across_two_daemons_without_local_world_size(cluster: PeeredDaemons) -> None:
    pytest.importorskip("jax")
    results = run_ranks(3, jax_pytree, 3, [cluster.sockets[n] for n in (0, 1, 1)], "jax-plain", timeout=180)
    assert results == [[], [], []], results


def test_a_single_daemon_keeps_todays_behaviour(daemon, tmp_path: Path) -> None:
    # No peers: nothing is exchanged or waited for; a job is the daemon's alone.
    results = run_ranks(2, plain, 2, [daemon.socket] * 2, "alone", timeout=120)
    assert all("error" not in r and not r["failures"] for r in results), results
