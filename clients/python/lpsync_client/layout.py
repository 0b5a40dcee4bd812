"""A job's layout, discovered: which node serves each rank, asked of the daemons.

Each rank asks the daemon it attaches to which node it is (the Node RPC: node rank, node
count, cluster identity) and publishes the answer through a store every rank of the job
reaches (torch's c10d store in the backend; anything with ``set``/``get`` for
``lpsync_client.connect(store=...)``). Rank 0 gathers every answer and publishes the
table; every rank judges that same table, so a contradiction fails every rank alike,
before the first collective, naming the ranks, the nodes and the variables:
  * ranks attached to daemons of different clusters (daemons that are not peers, each of
    which would serve its ranks as if the job were single-node);
  * LOCAL_WORLD_SIZE / LOCAL_RANK that disagree with what the daemons said: they are
    hints, checked, never used to place a rank.
Ranks need not be node-major, and nodes may serve different numbers of ranks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from lpsync_client.errors import InvalidArgumentError, LpsyncError, from_status

_SHOWN = 8  # contradictions named one by one; the rest are counted
_LINGER = 10.0  # seconds a failing rank 0 keeps the store up for the others to read


class Store(Protocol):
    """What the exchange needs of a store: torch.distributed's stores (TCPStore,
    FileStore, PrefixStore, the group store the backend gets) have both."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes:  # waits until ``key`` is set (the store's timeout)
        ...


@dataclass(frozen=True)
class Node:
    """A daemon as it describes itself (NodeInfo)."""

    node_rank: int
    nodes: int  # daemons in its cluster; 1: it has no peers
    cluster: str  # the same on every daemon of one cluster


@dataclass(frozen=True)
class Hints:
    """What the launcher said of this rank's node (torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE); local_world_size 0: nothing said, nothing checked."""

    local_rank: int = 0
    local_world_size: int = 0


def discover(
    store: Store, prefix: str, job: str, rank: int, world_size: int, ask: Callable[[], Node], hints: Hints
) -> list[int]:
    """The node of every rank of ``job`` (by rank). ``ask`` asks this rank's daemon; its
    failure is published too, so that the other ranks fail at once instead of waiting."""
    mine: dict[str, Any] = {"local_rank": hints.local_rank, "local_world_size": hints.local_world_size}
    failure: LpsyncError | None = None
    try:
        node = ask()
        mine.update(node=node.node_rank, nodes=node.nodes, cluster=node.cluster)
    except LpsyncError as error:
        failure = error
        mine["error"] = [error.code, str(error)]
    if failure is not None and rank != 0:  # its own error says it all: no need to wait
        store.set(f"{prefix}/{rank}", json.dumps(mine).encode())
        store.set(f"{prefix}/read/{rank}", b"1")
        raise failure
    table = exchange(store, prefix, rank, world_size, mine)
    try:
        if failure is not None:
            raise failure
        return judge(table, job)
    except LpsyncError:
        if rank == 0:
            _linger(store, prefix, world_size)
        raise


def exchange(store: Store, prefix: str, rank: int, world_size: int, mine: dict[str, Any]) -> list[dict]:
    """Every rank's entry, by rank: each rank sets its own key, rank 0 gathers them all
    (one multi_get where the store has it) and sets the table, the others read it and
    say so."""
    store.set(f"{prefix}/{rank}", json.dumps(mine).encode())
    if rank == 0:
        keys = [f"{prefix}/{r}" for r in range(world_size)]
        multi_get = getattr(store, "multi_get", None)
        values = multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]
        raw = b"[" + b",".join(_bytes(v) for v in values) + b"]"
        store.set(f"{prefix}/all", raw)
    else:
        raw = _bytes(store.get(f"{prefix}/all"))
        store.set(f"{prefix}/read/{rank}", b"1")
    table = json.loads(raw)
    if not isinstance(table, list) or len(table) != world_size:
        raise InvalidArgumentError(f"the layout table under {prefix!r} is not {world_size} ranks' entries")
    return table


def _linger(store: Store, prefix: str, world_size: int) -> None:
    """Rank 0 is about to fail: where it hosts the store (torch's TCPStore in rank 0, as
    init_process_group makes it), the others must read the table before it exits, or they
    get 'connection reset' instead of the error. Bounded: a store with ``wait`` (torch's)
    waits at most _LINGER seconds for their word; others are not waited for."""
    wait = getattr(store, "wait", None)
    if wait is None or world_size == 1:
        return
    with contextlib.suppress(Exception):  # a rank that never reads: give up after the bound
        wait([f"{prefix}/read/{r}" for r in range(1, world_size)], timedelta(seconds=_LINGER))


def judge(table: Sequence[dict[str, Any]], job: str) -> list[int]:
    """The node of every rank, or the error every rank raises alike."""
    failed = [(r, e["error"]) for r, e in enumerate(table) if "error" in e]
    if failed:
        r, (code, message) = failed[0]
        others = f" (and rank(s) {_ranks([r for r, _ in failed[1:]])})" if len(failed) > 1 else ""
        raise from_status(
            code, f"job {job!r}: rank {r}{others} could not ask its daemon which node it is: {message}"
        )
    node_of = [int(e["node"]) for e in table]
    clusters = {e["cluster"] for e in table}
    if len(clusters) > 1:
        raise InvalidArgumentError(
            f"job {job!r}: its ranks attached to daemons of {len(clusters)} different clusters "
            f"({_where(table)}). Those daemons are not peers, so each would serve its ranks as "
            "if the job ran on one node and wait for the others until the timeout. Start every "
            "node's daemon with the same --peers (--peers-dns, --peers-slurm), or attach all "
            "ranks to one daemon (LPSYNC_SOCKET)"
        )
    wrong = _contradicted_hints(table, node_of)
    if wrong:
        more = f"; and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
        raise InvalidArgumentError(
            f"job {job!r}: LOCAL_WORLD_SIZE / LOCAL_RANK contradict the nodes the ranks' "
            f"daemons reported ({_layout(node_of)}): {'; '.join(wrong[:_SHOWN])}{more}. "
            "They are hints: unset them or fix what sets them (the launcher)"
        )
    return node_of


def _contradicted_hints(table: Sequence[dict[str, Any]], node_of: list[int]) -> list[str]:
    """One line per rank whose hints say otherwise than the daemons."""
    on_node: dict[int, list[int]] = {}
    for r, n in enumerate(node_of):
        on_node.setdefault(n, []).append(r)
    wrong = []
    for r, entry in enumerate(table):
        size, local = int(entry.get("local_world_size", 0)), int(entry.get("local_rank", 0))
        mine = on_node[node_of[r]]
        if size and (size != len(mine) or local != mine.index(r)):
            wrong.append(
                f"rank {r} has LOCAL_WORLD_SIZE={size}, LOCAL_RANK={local}, but node {node_of[r]} "
                f"serves {_ranks(mine, 'rank')} (so {len(mine)} and {mine.index(r)})"
            )
    return wrong


def _where(table: Sequence[dict[str, Any]]) -> str:
    """'ranks 0, 2 on node 0 of 2 of cluster peers-ab12; rank 1 on node 0 of 1 of cluster
    host/9f3c (no peers)'."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for r, e in enumerate(table):
        groups.setdefault((e["cluster"], int(e["node"]), int(e["nodes"])), []).append(r)
    return "; ".join(
        f"{_ranks(ranks, 'rank')} on node {node} of {nodes} of cluster {cluster}"
        + (" (no peers)" if nodes == 1 else "")
        for (cluster, node, nodes), ranks in groups.items()
    )


def _layout(node_of: Sequence[int]) -> str:
    """'node 0: ranks 0-2; node 1: rank 3'."""
    nodes = sorted(set(node_of))
    text = "; ".join(
        f"node {n}: {_ranks([r for r, m in enumerate(node_of) if m == n], 'rank')}" for n in nodes
    )
    return text if len(text) <= 400 else text[:400] + "…"


def _ranks(ranks: Sequence[int], noun: str = "") -> str:
    """'0-2, 5', or with a noun 'ranks 0-2, 5' / 'rank 3'; consecutive runs folded."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    if not noun:
        return text
    return f"{noun} {text}" if len(ranks) == 1 else f"{noun}s {text}"


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
