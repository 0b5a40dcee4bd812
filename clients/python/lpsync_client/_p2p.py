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

Receive from any source: the senders' daemons announce each send to the receiver's
daemon (its inbox, lpsync/daemon/collectives/inbox.py); the receiver asks its daemon which
rank's message comes next (a Probe, counting the receives it issued already from each
source as spoken for) and then receives from that rank as above. A tag's any-source
receives run one at a time, in the order issued, each probe after the previous one's
receives were issued: MPI's matching order.

A host array is copied through an array of the pair's own shared memory (``_Pair``),
the same one each time for the same dtype and shape: the pair's request then repeats, and
from its third call a blocking send or receive rings the engine's doorbell like a
collective (an asynchronous one queues a ring). The user's array itself is unknown to the
pair's session (the daemon keeps buffers per session), and a scratch segment taken anew
each call would never repeat. A call made while the pair's copy is in use by an earlier
one of the same pair goes the old way (staged through scratch).

A device array is registered on the pair's own session as the framework adapters
register theirs (lpsync_client._adapt: weakly, released once the array is collected), not
for good: the caller cannot release it from a session it never sees.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from lpsync_client._device import is_device_array
from lpsync_client._pending import Call
from lpsync_client.errors import InvalidArgumentError, LpsyncError, UnavailableError
from lpsync_client.wire.pairs import MAX_TAG, pair_job

_COPIES_KEPT = 4  # a pair's arrays to copy host messages through, by (dtype, shape)


class _Pair:
    """One pair job's client and the arrays of its own shared memory that host messages
    are copied through (a repeated request: armed, answered by the engine)."""

    def __init__(self, client) -> None:
        self.client = client
        self._copies: dict[tuple, np.ndarray] = {}
        self._busy = False  # a call is using a copy now
        self._lock = threading.Lock()

    def take(self, x: np.ndarray) -> np.ndarray | None:
        """The pair's array for a message like ``x``, now this call's; None while an
        earlier call uses one (that call's data is still in it)."""
        key = (x.dtype, x.shape)
        with self._lock:
            if self._busy:
                return None
            self._busy = True
            copy = self._copies.get(key)
        if copy is not None:
            self._copies[key] = self._copies.pop(key)  # the most recently used last
            return copy
        try:
            if len(self._copies) >= _COPIES_KEPT:  # the least recently used goes (its plan too)
                self.client.release(self._copies.pop(next(iter(self._copies))))
            copy = self._copies[key] = self.client.empty(x.shape, x.dtype)
        except BaseException:
            self.give_back()
            raise
        return copy

    def give_back(self) -> None:
        with self._lock:
            self._busy = False


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
        self._any: dict[int, ThreadPoolExecutor] = {}  # by tag: its any-source receives, in order
        self._closed = False

    def _pair(self, src: int, dst: int, tag: int) -> _Pair:
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
                job = pair_job(self.job, src, dst, tag)
                client = self._open(
                    job, 0 if self.rank == src else 1, [self._node_of(src), self._node_of(dst)]
                )
                pair = self._pairs[(src, dst, tag)] = _Pair(client)
        return pair

    def send(self, x, peer: int, tag: int, timeout: float | None, now: bool = False) -> Future:
        """``now``: the caller waits for it at once (a blocking send): answered on this
        thread, the Future returned done."""
        return self._move(self._pair(self.rank, peer, tag), x, timeout, now, sending=True)

    def recv(self, x, peer: int, tag: int, timeout: float | None, now: bool = False) -> Future:
        return self._move(self._pair(peer, self.rank, tag), x, timeout, now, sending=False)

    @staticmethod
    def _move(pair: _Pair, x, timeout: float | None, now: bool, sending: bool) -> Future:
        if type(x) is np.ndarray and x.size and (sending or x.flags.writeable):
            copy = pair.take(x)
            if copy is not None:
                return _through(pair, copy, x, timeout, now, sending)
        return _staged(pair.client, x, timeout)

    def issued(self, tag: int) -> dict[int, int]:
        """By source: the receives from it with ``tag`` this rank has issued (the last
        sequence number of that pair job), which a probe counts as spoken for."""
        with self._lock:
            pairs = [
                (s, pair.client) for (s, d, t), pair in self._pairs.items() if d == self.rank and t == tag
            ]
        return {src: pair._sequence for src, pair in pairs if pair._sequence}

    def any_source(self, tag: int, receive: Callable[[], tuple[int, Future | None]]) -> Future:
        """A Future of the sending rank: ``receive()`` probes and issues the receives from
        the rank it found, returning (rank, a Future done when they are, or None), after
        the earlier any-source receives of ``tag`` did the same."""
        if not 0 <= tag < MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} is outside 0..{MAX_TAG - 1}")
        outer: Future = Future()

        def step() -> None:
            try:
                source, received = receive()
            except BaseException as error:
                outer.set_exception(error)
                return
            if received is None:
                outer.set_result(source)
                return

            def done(f: Future) -> None:
                error = None if f.cancelled() else f.exception()
                outer.set_result(source) if error is None else outer.set_exception(error)

            received.add_done_callback(done)

        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this client is closed")
            queue = self._any.get(tag)
            if queue is None:
                queue = self._any[tag] = ThreadPoolExecutor(1, f"lpsync-any-source-{tag}")
            queued = queue.submit(step)

        def closed(f: Future) -> None:  # closed before its turn: fail it, never leave it waiting
            if f.cancelled():
                outer.set_exception(UnavailableError("the client was closed"))

        queued.add_done_callback(closed)
        return outer

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            queues, self._any, self._closed = list(self._any.values()), {}, True
        for queue in queues:
            queue.shutdown(wait=False, cancel_futures=True)
        for pair in pairs:
            pair.client.close()


def _release_quietly(pair, registered) -> None:
    with contextlib.suppress(LpsyncError):  # the pair's session ended: released with it
        pair.release(registered)


def _staged(pair, x, timeout: float | None) -> Future:
    """``x`` moved as it is: staged through the pair's scratch, or a device array
    registered on the pair's session for the call."""
    held = None
    if is_device_array(x):
        held = pair.ensure_registered(x)
    try:
        future = pair.broadcast_async(x, root=0, timeout=timeout)
    except BaseException:
        if held is not None:
            _release_quietly(pair, held)
        raise
    if held is not None:  # an array it could not tie the registration to: for the call
        future.add_done_callback(lambda _: _release_quietly(pair, held))
    return future


def _through(
    pair: _Pair, copy: np.ndarray, x: np.ndarray, timeout: float | None, now: bool, sending: bool
) -> Future:
    """``x`` moved through the pair's own array ``copy`` (taken: given back when done)."""
    client = pair.client
    if not now:
        try:
            if sending:
                np.copyto(copy, x)
            inner = client.broadcast_async(copy, root=0, timeout=timeout)
        except BaseException:
            pair.give_back()
            raise
        outer = Call()
        outer.on_cancel = inner.cancel  # the caller's cancel reaches the daemon as before

        def done(f: Future) -> None:
            if f.cancelled():
                pair.give_back()
                outer.cancel()
                return
            try:
                error = f.exception()
                if error is None and not sending:
                    np.copyto(x, copy)
            except BaseException as failure:
                error = failure
            finally:
                pair.give_back()
            outer.set_exception(error) if error is not None else outer.set_result(x)

        inner.add_done_callback(done)
        return outer
    try:
        if sending:
            np.copyto(copy, x)
        client._blocking(lambda: client.broadcast_async(copy, root=0, timeout=timeout), timeout)
        if not sending:
            np.copyto(x, copy)
    finally:
        pair.give_back()
    answered: Future = Future()
    answered.set_result(x)
    return answered
