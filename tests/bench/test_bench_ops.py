"""``lpsync bench --op gather|scatter|alltoall|sendrecv``: the verify pass's expected buffers
against a numpy model of each op, and each op's bench path once through a real daemon
(sendrecv also through gloo; #wrong == 0 on both). The cluster path:
tests/cluster/test_cluster_bench.py."""

from __future__ import annotations

import numpy as np
import pytest

from lpsync.bench import OPS, worker
from lpsync_client.wire import blocks
from tests.daemon.harness import run_ranks

NEW = ("gather", "scatter", "alltoall", "sendrecv")


def _model(op: str, inputs: list[np.ndarray], world: int, count: int, root: int) -> list[np.ndarray]:
    """Every rank's output blocks, from every rank's input blocks (numpy, by definition)."""

    def block(a: np.ndarray, i: int) -> np.ndarray:
        return a[i * count : (i + 1) * count]

    if op == "gather":
        return [np.concatenate(inputs) if r == root else np.empty(0) for r in range(world)]
    if op == "scatter":
        return [block(inputs[root], r) for r in range(world)]
    if op == "sendrecv":  # a ring: each rank gets the previous rank's buffer
        return [inputs[(r - 1) % world] for r in range(world)]
    return [np.concatenate([block(inputs[s], r) for s in range(world)]) for r in range(world)]  # alltoall


@pytest.mark.parametrize("op", NEW)
@pytest.mark.parametrize(("world", "root"), [(1, 0), (3, 0), (4, 2)])
def test_expected_buffers_follow_the_ops_definition(op: str, world: int, root: int) -> None:
    count = 3
    sides = [worker.expected(op, r, world, count, root) for r in range(world)]
    inputs, outputs = [], []
    for r, (before, after) in enumerate(sides):
        n_in, n_out = blocks(op, world, r, root)
        # buffers as lpsync and gloo get them: in place, alltoall also an out
        assert [b.size for b in before] == [b.size for b in after]
        assert [b.size for b in before] == [n for n in worker.buffers(op, world, count, r, root) if n]
        # in place, the smaller side is this rank's block of the buffer (or nothing)
        mine = slice(r * count, r * count + min(n_in, n_out) * count)
        inputs.append(before[0] if n_in >= n_out else before[0][mine])
        outputs.append(after[-1] if n_out >= n_in else after[0][mine])
        if len(before) == 1 and n_in > n_out:  # the rest of the input stays
            rest = np.ones(before[0].size, bool)
            rest[mine] = False
            assert after[0][rest].tolist() == before[0][rest].tolist()
        # an untouched buffer is counted wrong wherever other ranks' data must arrive
        receives = op in ("alltoall", "sendrecv") or (op == "gather") == (r == root)
        wrong = worker.count_wrong(op, [b.copy() for b in before], r, world, count, root)
        assert (wrong > 0) == receives or world == 1
    want = _model(op, inputs, world, count, root)
    assert [o.tolist() for o in outputs] == [w.tolist() for w in want]
    assert (
        len({v for x in inputs for v in x.tolist()}) == sum(x.size for x in inputs) // count
    )  # blocks differ


def test_size_is_the_whole_p_block_buffer_and_the_table_has_the_ops() -> None:
    from lpsync.bench.runner import Options, Row, report  # here: the ranks import this module

    assert set(NEW) <= set(OPS)
    for op in NEW[:3]:
        assert worker.element_count(op, 4 * 4096, 4) == 1024  # count: one rank's block
    assert worker.buffers("gather", 4, 1024, 0) == (4096, 0)
    assert worker.buffers("gather", 4, 1024, 3) == (1024, 0)
    assert worker.buffers("scatter", 4, 1024, 1) == (1024, 0)
    assert worker.buffers("alltoall", 4, 1024, 1) == (4096, 4096)
    assert worker.element_count("sendrecv", 4 * 4096, 4) == 4096  # one message
    assert worker.buffers("sendrecv", 4, 4096, 1) == (4096, 4096)
    n = 1 << 24
    rows = {"lpsync": [Row(n, n // 16, [0.002], 0)], "gloo": [Row(n, n // 16, [0.004], 0)]}
    line = report(Options("gather", [n], 4, compare="gloo"), rows, False).splitlines()[3].split()
    assert line[:5] == [str(n), str(n // 16), "float32", "none", "0"]  # root 0, no redop
    assert float(line[8]) == pytest.approx(n / 0.002 / 1e9 * 3 / 4, abs=1e-3)  # busbw: (P-1)/P
    assert line[-1] == "2.00x"  # gloo's time / lpsync's
    line = report(Options("alltoall", [n], 4), {"lpsync": rows["lpsync"]}, False).splitlines()[3].split()
    assert line[3:5] == ["none", "-1"]


def _bench_rank(rank: int, world: int, socket: str, ops: tuple[str, ...], compare: str | None) -> list[tuple]:
    got = []
    for op in ops:
        rows: list[dict] = []
        worker.run(rank, world, socket, f"bench-ops-{op}", op, [4, 65536], None, 1, 0, compare, rows.append)
        got += [(r["engine"], op, r["bytes"], r["count"], r["wrong"]) for r in rows]
    return got


def test_each_new_op_benchmarks_with_nothing_wrong(daemon) -> None:
    """worker.run, as `lpsync bench --op OP` runs it in each rank: one timed iteration per
    size, then the verify pass. The gloo side (torch's import alone takes seconds per
    rank) runs in the cluster test, tests/cluster/test_cluster_bench.py."""
    ranks = run_ranks(3, _bench_rank, 3, daemon.socket, NEW[:3], None, timeout=60)
    for rank, rows in enumerate(ranks):
        assert rows == [("lpsync", op, n, max(1, n // 4 // 3), 0) for op in NEW[:3] for n in (4, 65536)], rank


def test_sendrecv_benchmarks_beside_gloo_with_nothing_wrong(daemon) -> None:
    """The ring of sends and receives through lpsync (two-rank jobs) and gloo's
    batch_isend_irecv: every rank's receive buffer holds the previous rank's message."""
    ranks = run_ranks(3, _bench_rank, 3, daemon.socket, ("sendrecv",), "gloo", timeout=120)
    for rank, rows in enumerate(ranks):
        assert rows == [(e, "sendrecv", n, n // 4, 0) for e in ("lpsync", "gloo") for n in (4, 65536)], rank


@pytest.mark.parametrize("flags", [["--algorithm", "lp"], ["--procs", "1"]])
def test_sendrecv_refuses_an_algorithm_and_a_single_rank(flags: list[str], capsys) -> None:
    from lpsync.cli import main

    assert main(["bench", "--op", "sendrecv", *flags]) == 2
    assert "--op sendrecv is point-to-point" in capsys.readouterr().err


def test_local_nodes_bench_the_device_pipeline_across_daemons() -> None:
    """``--local-nodes 2 --memory emulated``: two daemons joined on loopback, two ranks on
    each, allreduce on emulated device buffers (the hierarchical pipeline), #wrong == 0."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [
            *(sys.executable, "-m", "lpsync.cli", "bench", "--memory", "emulated", "--local-nodes", "2"),
            *(
                "--procs",
                "4",
                "--op",
                "allreduce",
                "--bytes",
                "1MiB",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--json",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["nodes"] == 2 and report["procs"] == 4 and report["memory"] == "emulated"
    (row,) = report["results"]["lpsync"]
    assert row["wrong"] == 0 and row["size"] == 1 << 20
