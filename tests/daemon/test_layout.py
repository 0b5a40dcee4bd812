"""A job's layout discovered, not assumed: the plain client's ranks ask their daemons which
node they are and exchange it through a store (torch's TCPStore here) before attaching.
Real daemons (three peered over TCP, and standalone ones), real rank processes, results
against numpy: one rank per node without LOCAL_WORLD_SIZE, uneven nodes, ranks not
node-major, two and three daemons; contradictions fail every rank at once. The daemon's
own checks (control/layout.py, limits.check_rank_nodes) first, without daemons."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from lpsync.daemon.collectives.agreement import failure_summary
from lpsync.daemon.control.layout import resolve
from lpsync.daemon.control.limits import check_rank_nodes
from lpsync.daemon.values import NodeLayout
from lpsync.engine.routing import Placement
from lpsync.errors import InvalidArgumentError, MismatchError, UnimplementedError
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc
from tests.daemon.harness import DaemonProcess, PeeredDaemons, run_ranks
from tests.daemon.layout_workers import inline_store_late_reader, one_allreduce, ops, refused
from tests.ports import free_ports

# -- the daemon's checks, no daemon ------------------------------------------------------------


def test_a_discovered_layout_is_any_map_of_ranks_to_nodes() -> None:
    layout = resolve("j", 2, 4, 0, 0, [1, 0, 1, 1], node=1, nodes=2)
    assert layout is not None
    assert (layout.nodes, layout.local_ranks, layout.by_node, layout.node_major) == (
        2,
        (0, 2, 3),
        (1, 0, 2, 3),
        False,
    )
    assert layout.describe() == "node 0: rank 1; node 1: ranks 0, 2-3"
    # Every rank on one node, whichever: a single-node job.
    assert resolve("j", 1, 2, 0, 0, [1, 1], node=1, nodes=3) is None
    # Hints that agree are accepted.
    assert resolve("j", 3, 4, 1, 2, [0, 1, 0, 1], node=1, nodes=2) == NodeLayout((0, 1, 0, 1), 1)
    # Any daemons of the cluster: the job numbers its nodes 0..N-1 and keeps the map.
    spread = resolve("j", 1, 3, 0, 0, [4, 2, 4], node=2, nodes=6)
    assert spread == NodeLayout((1, 0, 1), 0, (2, 4))
    assert spread is not None and spread.describe() == "node 2: rank 1; node 4: ranks 0, 2"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        # rank 1 attaches to node 0, but the map puts it on node 1
        (("j", 1, 2, 0, 0, [0, 1], 0, 2), ["attached to node 0", "puts it on node 1"]),
        # LOCAL_WORLD_SIZE=2 says node 1 serves two ranks; the map gives it one
        (("j", 1, 2, 1, 2, [0, 1], 1, 2), ["LOCAL_WORLD_SIZE=2", "LOCAL_RANK=1", "node 1 serves rank 1"]),
        # torchrun's numbering: rank 1 of LOCAL_WORLD_SIZE=1 belongs on node 1, not 0
        (("j", 1, 2, 0, 1, [], 0, 2), ["LOCAL_WORLD_SIZE=1", "belongs on node 1", "node 0 of 2"]),
        # not node-major: RANK 1 with LOCAL_RANK 0 of 2
        (("j", 1, 4, 0, 2, [], 0, 2), ["not a node-major layout", "LOCAL_RANK 0"]),
    ],
)
def test_a_contradicted_layout_is_refused_naming_ranks_nodes_and_variables(args, words) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        resolve(*args)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_claimed_layouts_keep_their_meaning() -> None:
    assert resolve("j", 3, 4, 1, 2, [], node=1, nodes=2) == NodeLayout((0, 0, 1, 1), 1)
    assert resolve("j", 1, 2, 1, 2, [], node=1, nodes=2) is None  # LOCAL_WORLD_SIZE = WORLD_SIZE
    assert resolve("j", 1, 2, 0, 0, [], node=1, nodes=2) is None  # nothing said: one node
    with pytest.raises(UnimplementedError, match="no peers"):
        resolve("j", 1, 2, 0, 1, [], node=0, nodes=1)


def test_rank_nodes_are_bounded_before_use() -> None:
    check_rank_nodes([], 5, 1)
    check_rank_nodes([0, 1, 1], 3, 2)
    with pytest.raises(InvalidArgumentError, match="3 entries for a world of size 4"):
        check_rank_nodes([0, 1, 1], 4, 2)
    with pytest.raises(InvalidArgumentError, match="rank 1 on node 2, but this daemon's cluster has 2"):
        check_rank_nodes([0, 2], 2, 2)
    with pytest.raises(InvalidArgumentError, match="no peers"):
        check_rank_nodes([0, 1], 2, 1)


def test_placement_of_any_map() -> None:
    placement = Placement.of((1, 0, 1), 1)
    assert placement.local_ranks == [0, 2]
    for bad in ((0, 2), (1, 1)):  # node 1 (or 0) without a participant
        with pytest.raises(InvalidArgumentError, match="every node needs"):
            Placement.of(bad, 0)


# -- real daemons ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = PeeredDaemons(tmp_path_factory.mktemp("layout"), 3, "--peer-transport", "tcp")
    try:
        deadline = time.monotonic() + 60  # timings below are of collectives, not of the mesh
        while not all("peer mesh up" in c.log(n) for n in range(3)) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield c
    except BaseException:
        c.stop()
        raise
    assert not (unclean := c.stop()), "\n".join(unclean)


def _port() -> int:
    """The port of a test's store: torch's TCPStore (the plain client itself needs no torch)."""
    pytest.importorskip("torch")
    return free_ports(1)[0]


def test_one_rank_per_node_without_local_world_size_runs_within_seconds(cluster: PeeredDaemons) -> None:
    # The case: two daemons, one rank each, no LOCAL_WORLD_SIZE (it hung before).
    results = run_ranks(2, one_allreduce, 2, cluster.sockets[:2], _port(), "one-per-node", timeout=60)
    assert all(r["ok"] for r in results), results
    # From connect() to the allreduce's result (well under 1 s on an idle machine; the
    # bound leaves room for a busy 2-core one).
    assert max(r["seconds"] for r in results) < 10, results


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param([0, 1, 0, 0], id="uneven-two-daemons-not-node-major"),
        pytest.param([1, 0, 0, 0], id="three-on-node0-one-on-node1-rank0-alone"),
        pytest.param([2, 0, 1, 0, 2], id="three-daemons-any-numbering"),
    ],
)
def test_every_op_on_a_discovered_layout(cluster: PeeredDaemons, nodes: list[int]) -> None:
    sockets = [cluster.sockets[n] for n in nodes]
    job = "layout-" + "".join(map(str, nodes))
    results = run_ranks(len(nodes), ops, len(nodes), sockets, _port(), job, timeout=180)
    for rank, result in enumerate(results):
        assert result["node"] == nodes[rank]
        assert result["rank_nodes"] == nodes
        assert not result["failures"], f"rank {rank}: {result['failures']}"


def test_a_rank_slow_to_read_the_table_still_reads_it_from_rank_0s_store(cluster: PeeredDaemons) -> None:
    # CI saw rank 1 fail with "connection closed" in the store's get: rank 0's connect()
    # had returned, and the TCPStore it hosted went with the last reference to it.
    results = run_ranks(
        2, inline_store_late_reader, 2, cluster.sockets[:2], _port(), "late-reader", timeout=60
    )
    assert results == [True, True]


def test_a_job_on_one_node_of_a_cluster_runs_there(cluster: PeeredDaemons) -> None:
    results = run_ranks(2, one_allreduce, 2, [cluster.sockets[2]] * 2, _port(), "on-node-2", timeout=60)
    assert all(r["ok"] for r in results), results


def test_a_wrong_local_world_size_fails_every_rank_at_once(cluster: PeeredDaemons) -> None:
    # torchrun's variables claiming both ranks share a node; their daemons say otherwise.
    sockets = cluster.sockets[:2]
    results = run_ranks(2, refused, 2, sockets, _port(), "wrong-lws", [(0, 2), (1, 2)], timeout=60)
    for result in results:
        assert result["code"] == "INVALID_ARGUMENT", result
        for word in ("LOCAL_WORLD_SIZE=2", "rank 0", "rank 1", "node 0: rank 0; node 1: rank 1"):
            assert word in result["error"], result
        assert result["seconds"] < 30, result


def test_a_job_on_daemons_1_and_2_runs_every_op(cluster: PeeredDaemons) -> None:
    """A job need not include daemon 0: it numbers its own nodes (values.NodeLayout)."""
    results = run_ranks(3, ops, 3, [cluster.sockets[n] for n in (2, 1, 2)], _port(), "skips-0", timeout=180)
    for rank, result in enumerate(results):
        assert result["rank_nodes"] == [2, 1, 2], result
        assert not result["failures"], f"rank {rank}: {result['failures']}"


def test_a_missing_daemon_fails_every_rank_at_once(cluster: PeeredDaemons, tmp_path: Path) -> None:
    sockets = [cluster.sockets[0], str(tmp_path / "nobody.sock")]
    results = run_ranks(2, refused, 2, sockets, _port(), "no-daemon", timeout=60)
    for result in results:
        assert result["code"] == "UNAVAILABLE", result
        assert "nobody.sock" in result["error"], result
        assert result["seconds"] < 30, result
    assert "rank 1 could not ask its daemon" in results[0]["error"], results[0]


def test_daemons_that_are_not_peers_fail_every_rank(tmp_path: Path) -> None:
    # Two standalone daemons, one rank each: each would serve its rank as a one-node job
    # and wait for the other until the timeout; the exchange sees two clusters.
    daemons = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        daemons.append(DaemonProcess(tmp_path / str(i)))
    try:
        sockets = [d.socket for d in daemons]
        results = run_ranks(2, refused, 2, sockets, _port(), "not-peers", timeout=60)
    finally:
        for d in daemons:
            d.stop_and_check()
    for result in results:
        assert result["code"] == "INVALID_ARGUMENT", result
        assert "2 different clusters" in result["error"] and "not peers" in result["error"], result
        assert "rank 0 on node 0 of 1" in result["error"] and "rank 1 on node 0 of 1" in result["error"]
        assert result["seconds"] < 30, result


# -- what the daemon itself checks at attach ----------------------------------------------------


def _attach(socket: str, **fields) -> pb.AttachResponse:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        return pb_grpc.LpSyncStub(channel).Attach(pb.AttachRequest(pid=1, **fields), timeout=10)


def _refusal(socket: str, **fields) -> str:
    with pytest.raises(grpc.RpcError) as error:
        _attach(socket, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
    return error.value.details()


def test_each_daemon_says_which_node_it_is(cluster: PeeredDaemons, daemon: DaemonProcess) -> None:
    infos = []
    for socket in cluster.sockets:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            infos.append(pb_grpc.LpSyncStub(channel).Node(pb.NodeRequest(), timeout=10))
    assert [(i.node_rank, i.nodes) for i in infos] == [(0, 3), (1, 3), (2, 3)]
    assert len({i.cluster for i in infos}) == 1
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        alone = pb_grpc.LpSyncStub(channel).Node(pb.NodeRequest(), timeout=10)
    assert (alone.node_rank, alone.nodes) == (0, 1) and alone.cluster != infos[0].cluster
    # Attach says it too; then the session is detached by its stream never opening.
    attached = _attach(cluster.sockets[1], job="node-info", rank=0, world_size=1)
    assert attached.node == infos[1]


def test_the_daemon_refuses_attaches_that_contradict_its_node(cluster: PeeredDaemons, daemon) -> None:
    node1 = cluster.sockets[1]
    text = _refusal(node1, job="c1", rank=0, world_size=2, rank_nodes=[0, 1])
    assert "attached to node 1" in text and "puts it on node 0" in text, text
    text = _refusal(node1, job="c2", rank=1, world_size=2, rank_nodes=[0, 3])
    assert "cluster has 3 node(s)" in text, text
    text = _refusal(node1, job="c3", rank=1, world_size=3, rank_nodes=[0, 1])
    assert "2 entries for a world of size 3" in text, text
    text = _refusal(
        node1, job="c4", rank=1, world_size=2, local_rank=1, local_world_size=2, rank_nodes=[0, 1]
    )
    assert "LOCAL_WORLD_SIZE=2" in text and "node 1 serves rank 1" in text, text
    # torchrun's numbering, no map: rank 0 of LOCAL_WORLD_SIZE=1 belongs on node 0
    text = _refusal(node1, job="c5", rank=0, world_size=2, local_rank=0, local_world_size=1)
    assert "LOCAL_WORLD_SIZE=1" in text and "belongs on node 0" in text, text
    text = _refusal(daemon.socket, job="c6", rank=0, world_size=2, rank_nodes=[0, 1])
    assert "no peers" in text, text
    # The daemon's log says why a rank never joined, too (the operator's side).
    refusals = [json.loads(line) for line in cluster.log(1).splitlines() if '"attach refused"' in line]
    c1 = next(r for r in refusals if r["job"] == "c1")
    assert (c1["rank"], c1["code"]) == (0, "INVALID_ARGUMENT") and "puts it on node 0" in c1["error"], c1


def test_ranks_of_one_job_that_bring_different_layouts_are_refused(cluster: PeeredDaemons) -> None:
    node1 = cluster.sockets[1]
    with grpc.insecure_channel(f"unix:{node1}") as channel:
        stub = pb_grpc.LpSyncStub(channel)
        first = stub.Attach(
            pb.AttachRequest(job="two-maps", rank=1, world_size=3, rank_nodes=[0, 1, 1]), timeout=10
        )
        try:
            with pytest.raises(grpc.RpcError) as error:
                stub.Attach(
                    pb.AttachRequest(job="two-maps", rank=2, world_size=3, rank_nodes=[1, 0, 1]), timeout=10
                )
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            text = error.value.details()
            assert "rank 2 says node 0: rank 1; node 1: ranks 0, 2" in text, text
            assert "rank 1 said node 0: rank 0; node 1: ranks 1-2" in text, text
        finally:
            stub.Detach(pb.DetachRequest(session_id=first.session_id), timeout=10)


def test_the_agreement_names_a_nodes_ranks_in_any_layout() -> None:
    # Node 1 serves ranks 0, 2 and 3: a mismatch or failure names them, not "ranks 0-3".
    layout = NodeLayout((1, 0, 1, 1), 1)
    job = SimpleNamespace(layout=layout, local_ranks=layout.local_ranks)
    failed = failure_summary(job, MismatchError("count differs"))
    assert failed.fields["ranks"] == "ranks 0, 2-3"
    assert failed.fields["error"][1].startswith("node 1 (ranks 0, 2-3): count differs")
    # Bounded however scattered a node's ranks are (the summary has a size limit).
    scattered = NodeLayout(tuple(r % 2 for r in range(1000)), 1)
    job = SimpleNamespace(layout=scattered, local_ranks=scattered.local_ranks)
    assert len(failure_summary(job, MismatchError("x")).alone) < 1000
