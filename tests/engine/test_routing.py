"""Multi-node routing: one schedule over every participant of several nodes, each node
running only its own participants' plans, local messages over the node's inproc fabric
and remote ones over a node-level Endpoint (here an inproc fabric of nodes standing in
for the network; tests/test_transport_* run the real transports)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lpsync.algorithms import Kind, generate
from lpsync.engine.group import LocalGroup, layout
from lpsync.engine.routing import Placement
from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError
from lpsync.reduction import Reduction
from lpsync.transport.inproc import InprocFabric
from lpsync.transport.tags import fold
from lpsync.types import Collective, ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    REDUCING,
    ROOTED,
    assert_matches,
    make_inputs,
    reference,
)


def run_nodes(
    op: Collective,
    algorithm: str,
    ranks_per_node: tuple[int, ...],
    count: int,
    root: int = 0,
    chunks: int = 4,
    dtype: type = np.int64,
    absent_node: int | None = None,
    timeout: float = 20.0,
) -> tuple[list[np.ndarray], list[np.ndarray], list[BaseException | None]]:
    p = sum(ranks_per_node)
    schedule = generate(op, algorithm, p, count, root, chunks)
    rng = np.random.default_rng(p * 1000 + count)
    inputs = make_inputs(op, p, count, np.dtype(dtype), ReduceOp.SUM, rng, root)
    network = InprocFabric(len(ranks_per_node))
    reduction = Reduction(ReduceOp.SUM, np.dtype(dtype), p) if op in REDUCING else None
    pairs = [layout(op, r, p, count, x.copy(), False, root) for r, x in enumerate(inputs)]
    errors: list[BaseException | None] = [None] * len(ranks_per_node)

    def node(n: int) -> None:
        placement = Placement.node_major(ranks_per_node, n)
        mine = [pairs[r] for r in placement.local_ranks]
        try:
            with LocalGroup(schedule, mine, reduction, placement, network.endpoint(n)) as group:
                group.run(timeout, tag_base=7 << 24)
        except BaseException as error:
            errors[n] = error

    threads = [
        threading.Thread(target=node, args=(n,)) for n in range(len(ranks_per_node)) if n != absent_node
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return inputs, [out for _, out in pairs], errors


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
@pytest.mark.parametrize("ranks_per_node", [(1, 1), (2, 1, 3), (1, 1, 1, 1, 1), (3, 3)])
def test_every_collective_across_nodes(
    op: Collective, algorithm: str, ranks_per_node: tuple[int, ...]
) -> None:
    p = sum(ranks_per_node)
    for root in sorted({0, p - 1}) if op in ROOTED else [0]:
        for count in (0, 5, 1001):
            inputs, outs, errors = run_nodes(op, algorithm, ranks_per_node, count, root)
            assert errors == [None] * len(ranks_per_node)
            for r, want in enumerate(reference(op, ReduceOp.SUM, inputs, root, count)):
                assert_matches(outs[r], want, f"{op} {algorithm} {ranks_per_node} rank {r}")


def test_lp_chain_crosses_each_node_boundary_once_per_direction() -> None:
    ranks_per_node = (2, 3, 2)
    placement = Placement.node_major(ranks_per_node, 0)
    s = generate(Collective.ALLREDUCE, "lp", sum(ranks_per_node), 1000, chunks=8)
    send = s.send_op
    src = placement.node_of
    links = {
        (src[s.ops["rank"][i]], src[s.ops["peer"][i]])
        for i in send
        if src[s.ops["rank"][i]] != src[s.ops["peer"][i]]
    }
    assert links == {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert all(s.ops["kind"][i] == Kind.SEND for i in send)


def test_a_node_that_never_comes_times_out_the_others() -> None:
    _, _, errors = run_nodes(Collective.ALLREDUCE, "lp", (1, 2, 1), 100, absent_node=2, timeout=1.0)
    assert errors[2] is None  # never started
    assert all(isinstance(e, CollectiveTimeoutError) for e in errors[:2])


def test_fold_keeps_every_message_apart() -> None:
    seen = {fold(s, d, t) for s in range(5) for d in range(5) for t in (0, 1, 7 << 24, (1 << 40) - 1)}
    assert len(seen) == 5 * 5 * 4
    with pytest.raises(InvalidArgumentError):
        fold(0, 1, 1 << 40)


def test_placement_rejects_impossible_layouts() -> None:
    with pytest.raises(InvalidArgumentError):
        Placement.node_major((2, 0), 0)
    with pytest.raises(InvalidArgumentError):
        Placement.node_major((2, 2), 2)
    with pytest.raises(InvalidArgumentError):
        LocalGroup(
            generate(Collective.ALLREDUCE, "ring", 4, 8), [], None, Placement.node_major((2, 2), 0), None
        )
