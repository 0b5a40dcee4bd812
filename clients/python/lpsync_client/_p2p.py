"""Point-to-point send/recv as two-rank jobs: the daemons' collectives do the moving.

A message from rank a to rank b with tag t is a broadcast from a (its rank 0) in the
job ``{job}/p2p/{a}>{b}/{t}`` of two ranks, attached lazily by both: inside a node one
shared-memory copy, across nodes the peer plane, with the daemons' failure model (a dead
peer fails the pending receive within the same bound as a collective). Each (source,
destination, tag) is its own job, so messages keep torch's order per (source,
destination, tag) — the job's sequence numbers — and neither the other direction nor
another tag ever waits on them. A receive buffer of another size than the message is a mismatch naming both
counts, never a truncation. The pair's ranks are placed where the main job's are (its
discovered layout, or node-major by LOCAL_WORLD_SIZE), so no store is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lpsync_client.errors import InvalidArgumentError

MAX_TAG = 1 << 31  # torch's tags are int32


class PairJobs:
    """The two-rank jobs one client opened, by (source, destination, tag); closed with it."""

    def __init__(
        self, job: str, rank: int, world_size: int, node_of: Callable[[int], int], open_pair
    ) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self._node_of = node_of
        self._open = open_pair  # (job, rank 0|1, [node of pair rank 0, of pair rank 1]) -> Client
        self._pairs: dict[tuple[int, int, int], Any] = {}
        self._lock = threading.Lock()

    def _pair(self, src: int, dst: int, tag: int):
        peer = dst if src == self.rank else src
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise InvalidArgumentError(
                f"peer {peer} is not another rank of this job of {self.world_size} (this is rank {self.rank})"
            )
        if not 0 <= tag < MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} is outside 0..{MAX_TAG - 1}")
        with self._lock:  # one attach per (source, destination, tag), whichever thread asks first
            pair = self._pairs.get((src, dst, tag))
            if pair is None:
                job = f"{self.job}/p2p/{src}>{dst}/{tag}"
                pair = self._open(job, 0 if self.rank == src else 1, [self._node_of(src), self._node_of(dst)])
                self._pairs[(src, dst, tag)] = pair
        return pair

    def send(self, x, peer: int, tag: int, timeout: float | None) -> Future:
        pair = self._pair(self.rank, peer, tag)
        return pair.broadcast_async(x, root=0, timeout=timeout)

    def recv(self, x, peer: int, tag: int, timeout: float | None) -> Future:
        pair = self._pair(peer, self.rank, tag)
        return pair.broadcast_async(x, root=0, timeout=timeout)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()
