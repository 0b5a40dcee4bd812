"""The backend discovers its groups' layouts: no LOCAL_WORLD_SIZE needed, any numbering of
ranks, nodes with different numbers of ranks, two and three daemons; a launcher whose
LOCAL_* variables contradict the daemons, or daemons that are not peers, fail every
rank's init_process_group at once, naming what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.client.torch_backend.layout_workers import first_all_reduce, ops, refused
from tests.daemon.harness import DaemonProcess, PeeredDaemons, run_ranks
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    cluster = PeeredDaemons(tmp_path_factory.mktemp("torch-three-nodes"), 3, "--peer-transport", "tcp")
    try:
        yield cluster
    finally:
        unclean = cluster.stop()
        assert not unclean, "\n".join(unclean)


def test_one_rank_per_node_without_local_world_size(two_nodes) -> None:
    # The case: it hung until the collective's timeout ("missing rank(s) 1").
    results = run_ranks(2, first_all_reduce, 2, two_nodes.sockets, free_ports(1)[0], timeout=90)
    assert all(r["ok"] for r in results), results
    # init_process_group + the first all_reduce (the mesh may still be forming when this
    # test runs first: a bound for a busy machine, not a measurement).
    assert max(r["seconds"] for r in results) < 20, results


def test_uneven_nodes_and_ranks_not_node_major_on_two_daemons(two_nodes) -> None:
    sockets = [two_nodes.sockets[n] for n in (1, 0, 0, 0)]  # rank 0 alone on node 1
    results = run_ranks(4, ops, 4, sockets, free_ports(1)[0], timeout=240)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def test_three_daemons_any_numbering(three_nodes) -> None:
    sockets = [three_nodes.sockets[n] for n in (2, 0, 1, 0)]
    results = run_ranks(4, ops, 4, sockets, free_ports(1)[0], timeout=240)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def test_a_wrong_local_world_size_fails_every_rank(two_nodes) -> None:
    # torchrun-style variables claiming both ranks share node 0; each is on its own daemon.
    results = run_ranks(2, refused, 2, two_nodes.sockets, free_ports(1)[0], [(0, 2), (1, 2)], timeout=90)
    for result in results:
        assert result["error"] is not None, result
        assert result["error"].startswith("DistBackendError: lpsync: rank"), result
        for word in ("LOCAL_WORLD_SIZE=2", "rank 0", "rank 1", "node 0: rank 0; node 1: rank 1"):
            assert word in result["error"], result
        assert result["seconds"] < 30, result


def test_daemons_that_are_not_peers_fail_every_rank(tmp_path: Path) -> None:
    daemons = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        daemons.append(DaemonProcess(tmp_path / str(i)))
    try:
        sockets = [d.socket for d in daemons]
        results = run_ranks(2, refused, 2, sockets, free_ports(1)[0], None, timeout=90)
    finally:
        for d in daemons:
            d.stop_and_check()
    for result in results:
        assert result["error"] is not None, result
        assert "2 different clusters" in result["error"] and "--peers" in result["error"], result
        assert result["seconds"] < 30, result


def test_torchrun_agents_of_unequal_size_on_two_daemons(two_nodes) -> None:
    # Two torchrun agents (one per "node", c10d rendezvous): 3 ranks on daemon 0, 1 on
    # daemon 1; torchrun numbers the ranks and sets LOCAL_* itself (checked, and right).
    port = free_ports(1)[0]
    agents = []
    for node, procs in ((0, 3), (1, 1)):
        env = dict(os.environ, LPSYNC_SOCKET=two_nodes.sockets[node], PYTHONPATH=str(ROOT))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--nproc-per-node", str(procs), "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "layout"]
        command += ["-m", "tests.client.torch_backend.layout_workers"]
        agents.append(
            subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=120)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    lines = [json.loads(line[7:]) for o in outputs for line in o.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in lines) == [0, 1, 2, 3], outputs
    for r in lines:
        assert r["world"] == 4 and r["sum"] == 10.0 and r["gathered"] == [0.0, 1.0, 2.0, 3.0], r
    per_daemon = {s: sum(r["socket"] == s for r in lines) for s in two_nodes.sockets}
    assert per_daemon == {two_nodes.sockets[0]: 3, two_nodes.sockets[1]: 1}, lines
    assert all(r["local"][1] == per_daemon[r["socket"]] for r in lines), lines
