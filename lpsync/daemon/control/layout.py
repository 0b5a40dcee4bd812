"""Which node serves each rank of a job: the layout one attach describes, checked, and the
layout the daemons saw (``placed``), which settles the job and checks every hint.

What one attach describes (``resolve``), checked against this daemon (node ``node`` of
``nodes``):
  * discovered (``rank_nodes``): the ranks asked their daemons which node they are (the
    Node RPC) and exchanged it through a store before attaching (lpsync_client.layout).
    Any map: ranks need not be node-major, nodes may serve different numbers of ranks.
    LOCAL_WORLD_SIZE / LOCAL_RANK, when the client passes them, are hints checked
    against it, never used to place a rank.
  * claimed (no map): torchrun's node-major numbering from LOCAL_WORLD_SIZE, as before
    discovery existed (node = rank // LOCAL_WORLD_SIZE); without it, one node.
  * none (no map, no LOCAL_WORLD_SIZE) on a daemon with peers: the daemons find it out
    (``placed``, from what each daemon told of the ranks attached to it: peers/attached.py).
A contradiction is InvalidArgumentError naming the rank, the nodes and the variable, at
attach. limits.check_rank_nodes has bounded ``rank_nodes`` before anything here runs.

On a daemon with peers every job's layout is also judged from where its ranks did attach
(``placed``): the same rank on two nodes, world sizes that differ, hints that put a rank
elsewhere than it attached are InvalidArgumentError naming the ranks and nodes; a rank
whose attach was refused somewhere is AbortedError naming it; ranks not attached anywhere
yet leave the job Unplaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lpsync.daemon.peers.attached import JobSeen
from lpsync.daemon.values import NodeLayout, ranks_text
from lpsync.errors import AbortedError, InvalidArgumentError, UnimplementedError
from lpsync.transport.tags import MAX_PARTICIPANTS


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
    layout = _layout(job, rank_nodes, node)
    if layout is None:  # every rank here: a single-node job, whichever node this is
        _check_hints(job, rank, local_rank, local_world_size, range(len(rank_nodes)), node, "one node")
        return None
    _check_hints(job, rank, local_rank, local_world_size, layout.local_ranks, node, _short(layout))
    return layout


def _layout(job: str, rank_nodes: Sequence[int], node: int) -> NodeLayout | None:
    """The layout of the daemons' map ``rank_nodes`` (by rank); None: all on ``node``."""
    used = sorted(set(rank_nodes))
    if used == [node]:
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
    return NodeLayout(tuple(index[n] for n in rank_nodes), index[node], cluster)


@dataclass(frozen=True)
class Hinted:
    """What an attach said of the job's layout, and so the layout it was given (resolve)."""

    layout: NodeLayout | None  # None: the job on one node, this one
    said: str  # the hints, as the attach gave them: "LOCAL_WORLD_SIZE=4, LOCAL_RANK=0"


@dataclass(frozen=True)
class Unplaced:
    """Ranks of the job not attached to any daemon of the cluster yet."""

    missing: tuple[int, ...]
    where: str  # where the others are: "node 0: ranks 0-1; node 1: rank 2"


def placed(
    job: str, world_size: int, node: int, seen: JobSeen, hinted: Hinted | None
) -> NodeLayout | Unplaced | None:
    """The job's layout from where its ranks attached (``seen``: every daemon's word,
    this one's ``node`` included), checked against ``hinted`` (None: no hint given);
    raises the contradiction every rank of the job gets."""
    where = _where(seen)
    sizes = sorted({size for size in seen.sizes.values()} | {world_size})
    if len(sizes) > 1:
        told = "; ".join(f"node {d}: {size}" for d, size in sorted(seen.sizes.items()))
        raise InvalidArgumentError(
            f"job {job!r}: its ranks attached with different world sizes ({told}); attached: {where}"
        )
    twice = {r: sorted(ds) for r, ds in sorted(seen.nodes_of.items()) if len(ds) > 1}
    if twice:
        named = "; ".join(f"rank {r} on nodes {', '.join(map(str, ds))}" for r, ds in list(twice.items())[:8])
        raise InvalidArgumentError(
            f"job {job!r}: the same rank attached to several nodes ({named}): two processes "
            f"claim it (check RANK and the job name); attached: {where}"
        )
    if hinted is not None:
        elsewhere = [
            (r, next(iter(ds)), _daemon_of(hinted.layout, r, node))
            for r, ds in sorted(seen.nodes_of.items())
            if next(iter(ds)) != _daemon_of(hinted.layout, r, node)
        ]
        if elsewhere:
            named = "; ".join(f"rank {r} attached to node {d}, not node {h}" for r, d, h in elsewhere[:8])
            raise InvalidArgumentError(
                f"job {job!r}: its hints ({hinted.said}) place ranks on other nodes than the "
                f"ones they attached to ({named}); the daemons saw {where}. Hints are checked, "
                "never trusted: unset them (the daemons find the layout) or fix what sets them"
            )
    refused = {r: why for r, why in seen.refused.items() if r not in seen.nodes_of}
    if refused:
        r, (daemon, why) = min(refused.items())
        more = f" (and {ranks_text(sorted(refused)[1:])})" if len(refused) > 1 else ""
        raise AbortedError(
            f"job {job!r}: rank {r}{more} could not attach (node {daemon} refused it: {why}); "
            f"the job cannot run until it attaches. Attached: {where}"
        )
    missing = tuple(r for r in range(world_size) if r not in seen.nodes_of)
    if missing:
        return Unplaced(missing, where)
    if hinted is not None:
        return hinted.layout
    return _layout(job, [next(iter(seen.nodes_of[r])) for r in range(world_size)], node)


def pair_nodes(parent: NodeLayout | None, source: int, destination: int, node: int) -> list[int]:
    """The daemons of a pair job's two ranks (a send's ``source``, its ``destination``) from
    its main job's settled layout here (None: that job is on this node alone)."""
    if parent is None:
        return [node, node]
    return [_daemon_of(parent, source, node), _daemon_of(parent, destination, node)]


def _daemon_of(layout: NodeLayout | None, rank: int, node: int) -> int:
    return node if layout is None else layout.daemon(layout.node_of[rank])


def _where(seen: JobSeen) -> str:
    """'node 0: ranks 0-1; node 1: rank 2' (by daemon), or 'no rank' when none is."""
    by_daemon: dict[int, list[int]] = {}
    for rank, daemons in seen.nodes_of.items():
        for d in daemons:
            by_daemon.setdefault(d, []).append(rank)
    text = "; ".join(f"node {d}: {ranks_text(rs)}" for d, rs in sorted(by_daemon.items())) or "no rank"
    return text if len(text) <= 400 else text[:400] + "…"


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
