"""Which node serves each rank of a job: the layout one attach describes, checked.

Two sources, both checked against this daemon (node ``node`` of ``nodes``):
  * discovered (``rank_nodes``): the ranks asked their daemons which node they are (the
    Node RPC) and exchanged it through a store before attaching (lpsync_client.layout).
    Any map: ranks need not be node-major, nodes may serve different numbers of ranks.
    LOCAL_WORLD_SIZE / LOCAL_RANK, when the client passes them, are hints checked
    against it, never used to place a rank.
  * claimed (no map): torchrun's node-major numbering from LOCAL_WORLD_SIZE, as before
    discovery existed (node = rank // LOCAL_WORLD_SIZE); without it, one node.
A contradiction is InvalidArgumentError naming the rank, the nodes and the variable, at
attach. limits.check_rank_nodes has bounded ``rank_nodes`` before anything here runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from lpsync.daemon.values import NodeLayout, ranks_text
from lpsync.engine.routing import MAX_PARTICIPANTS
from lpsync.errors import InvalidArgumentError, UnimplementedError


def resolve(
    job: str,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    rank_nodes: Sequence[int],
    node: int,
    nodes: int,
) -> NodeLayout | None:
    """The job's layout as this attach describes it; None: a single-node job.
    ``local_world_size`` 0: no hint given; ``nodes`` 1: this daemon has no peers."""
    if rank_nodes:
        return _discovered(job, rank, local_rank, local_world_size, rank_nodes, node)
    return _claimed(job, rank, world_size, local_rank, local_world_size, node, nodes)


def _discovered(
    job: str, rank: int, local_rank: int, local_world_size: int, rank_nodes: Sequence[int], node: int
) -> NodeLayout | None:
    if rank_nodes[rank] != node:
        raise InvalidArgumentError(
            f"rank {rank} of job {job!r} attached to node {node}, but its discovered layout "
            f"puts it on node {rank_nodes[rank]}: the layout is stale or was made for other "
            "daemons (each rank must attach to the daemon it asked)"
        )
    used = sorted(set(rank_nodes))
    if used == [node]:  # every rank here: a single-node job, whichever node this is
        _check_hints(job, rank, local_rank, local_world_size, range(len(rank_nodes)), node, "one node")
        return None
    # Sized from the map only now that it is bounded (a multi-node job is at most this big).
    if len(rank_nodes) > MAX_PARTICIPANTS:
        raise InvalidArgumentError(
            f"job {job!r} of {len(rank_nodes)} ranks spans nodes; a multi-node job has at "
            f"most {MAX_PARTICIPANTS} ranks"
        )
    # Any daemons of the cluster: the job numbers its own nodes 0..N-1 (values.NodeLayout).
    index = {daemon: i for i, daemon in enumerate(used)}
    cluster = () if used == list(range(len(used))) else tuple(used)
    layout = NodeLayout(tuple(index[n] for n in rank_nodes), index[node], cluster)
    _check_hints(job, rank, local_rank, local_world_size, layout.local_ranks, node, _short(layout))
    return layout


def _check_hints(
    job: str, rank: int, local_rank: int, local_world_size: int, mine: Sequence[int], node: int, layout: str
) -> None:
    """LOCAL_WORLD_SIZE / LOCAL_RANK, when given, must say what the layout says."""
    if local_world_size and (local_world_size != len(mine) or local_rank != mine.index(rank)):
        raise InvalidArgumentError(
            f"rank {rank} of job {job!r} claims LOCAL_WORLD_SIZE={local_world_size}, "
            f"LOCAL_RANK={local_rank}, but node {node} serves {ranks_text(mine)} of the job "
            f"(so {len(mine)} and {mine.index(rank)}); its layout: {layout}"
        )


def _claimed(
    job: str, rank: int, world_size: int, local_rank: int, per_node: int, node: int, nodes: int
) -> NodeLayout | None:
    spans = bool(per_node) and (per_node != world_size or local_rank != rank)
    if not spans:
        return None
    if nodes == 1:
        raise UnimplementedError(
            f"job {job!r} spans several nodes (world size {world_size}, LOCAL_WORLD_SIZE "
            f"{per_node}) but this daemon has no peers: start it with --peers, --peers-dns "
            "or --peers-slurm"
        )
    if world_size % per_node or local_rank != rank % per_node:
        raise InvalidArgumentError(
            f"job {job!r}: RANK {rank}, LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE {per_node}, "
            f"WORLD_SIZE {world_size} is not a node-major layout (RANK = node_rank * "
            "LOCAL_WORLD_SIZE + LOCAL_RANK, the same LOCAL_WORLD_SIZE on every node); "
            "let the ranks discover their layout instead (lpsync_client.connect(store=...), "
            "or the torch backend)"
        )
    claimed, home = world_size // per_node, rank // per_node
    if home != node or claimed > nodes:
        raise InvalidArgumentError(
            f"rank {rank} of job {job!r} (LOCAL_WORLD_SIZE={per_node}: {claimed} nodes of "
            f"{per_node} ranks) belongs on node {home}, but this daemon is node {node} of "
            f"{nodes}: attach each node's ranks to daemon RANK // LOCAL_WORLD_SIZE of --peers, "
            "or let the ranks discover their layout (lpsync_client.connect(store=...), or "
            "the torch backend)"
        )
    return NodeLayout.uniform(per_node, claimed, node)


def _short(layout: NodeLayout) -> str:
    text = layout.describe()
    return text if len(text) <= 400 else text[:400] + "…"
