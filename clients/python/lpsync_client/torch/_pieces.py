"""Tensors of any size: a message larger than one daemon buffer (``--max-buffer-bytes``)
travels as several collectives over consecutive element ranges, issued in the same order
on every rank (collectives are matched by sequence number).

The daemon does not announce its limit at attach; it names it when it refuses a buffer
(RESOURCE_EXHAUSTED: "... exceeds the daemon's limit of N bytes (--max-buffer-bytes)").
``learn`` keeps that number per client, so the refused allocation is made again in pieces
and later ones are cut at once. Every rank attached to one daemon learns the same limit
from the same refusal, hence cuts the same pieces.

``bounds`` is the one rule every split follows (the backend's operations, the DDP hook,
DistributedOptimizer); ``Pieced`` is a flat shared-memory buffer made of such pieces.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from lpsync_client.client import Client
from lpsync_client.errors import ResourceExhaustedError

_LIMIT = re.compile(r"(\d+) bytes\W{0,3}--max-buffer-bytes")
_limits: weakref.WeakKeyDictionary[Client, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def bounds(total: int, per_piece: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most ``per_piece`` (at least 1) elements covering
    [0, total), in order."""
    step = max(1, per_piece)
    for start in range(0, total, step):
        yield start, min(start + step, total)


def buffer_limit(client: Client) -> int | None:
    """The largest buffer ``client``'s daemon accepts, in bytes; None until it refused one."""
    with _lock:
        return _limits.get(client)


def learn(client: Client, error: BaseException) -> bool:
    """Whether ``error`` is the daemon refusing a buffer over its --max-buffer-bytes below
    what was known: then its limit is kept for ``client`` (cut again and retry)."""
    found = _LIMIT.search(str(error)) if isinstance(error, ResourceExhaustedError) else None
    if found is None:
        return False
    limit = int(found.group(1))
    with _lock:
        known = _limits.get(client)
        if known is not None and known <= limit:
            return False
        _limits[client] = limit
    return True


def all_done(futures: Sequence[Future]) -> Future:
    """A future completed once every one of ``futures`` is: with the first error, if any."""
    if len(futures) == 1:
        return futures[0]
    combined: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is None:
            combined.set_result(None)
        else:
            combined.set_exception(error)

    for f in futures:
        f.add_done_callback(done)
    return combined


# What the client takes for each dtype: numpy views, torch's own view for bfloat16 (numpy
# has none).
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


class Pieced:
    """``numel`` elements of ``dtype`` in shared memory registered once, as consecutive
    arrays each within the daemon's buffer limit (one array when the whole fits); collectives
    run one per array, in order."""

    def __init__(self, client: Client, numel: int, dtype: torch.dtype) -> None:
        self.client, self.numel, self.dtype = client, numel, dtype
        # (first element, shared-memory array, torch view of it)
        self.pieces: list[tuple[int, np.ndarray, torch.Tensor]] = []
        while True:
            limit = buffer_limit(client)
            try:
                per_piece = numel if limit is None else limit // dtype.itemsize
                for start, stop in list(bounds(numel, per_piece)) or [(0, 0)]:  # even empty: one
                    array = client.empty((stop - start) * dtype.itemsize, "uint8")
                    self.pieces.append((start, array, torch.from_numpy(array).view(dtype)))
                return
            except ResourceExhaustedError as error:
                self.release()
                if not learn(client, error):
                    raise

    def spans(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first element, view of the buffer) covering elements [start, stop), in order."""
        for first, _, view in self.pieces:
            lo, hi = max(start, first), min(stop, first + view.numel())
            if lo < hi:
                yield lo, view[lo - first : hi - first]

    def write(self, start: int, source: torch.Tensor) -> None:
        """Copy ``source`` (any shape, layout or device) to elements from ``start`` on."""
        flat = source.detach().reshape(-1)
        for lo, view in self.spans(start, start + flat.numel()):
            view.copy_(flat[lo - start : lo - start + view.numel()])

    def zero(self, start: int, stop: int) -> None:
        for _, view in self.spans(start, stop):
            view.zero_()

    def read(self, start: int, out: torch.Tensor) -> None:
        """Copy elements from ``start`` on into ``out`` (any shape, layout or device)."""
        parts = [view for _, view in self.spans(start, start + out.numel())]
        out.copy_((parts[0] if len(parts) == 1 else torch.cat(parts)).view(out.shape))

    def allreduce_async(self, op: str, timeout: float | None, name: str) -> Future:
        """One allreduce per piece, in order; a future completed when all are."""
        several = len(self.pieces) > 1
        return all_done(
            [
                self.client.allreduce_async(
                    view if self.dtype not in _NUMPY else array.view(_NUMPY[self.dtype]),
                    op=op,
                    timeout=timeout,
                    name=f"{name}/piece{i}" if several else name,
                )
                for i, (_, array, view) in enumerate(self.pieces)
            ]
        )

    def release(self) -> None:
        for _, array, _ in self.pieces:
            self.client.release(array)
        self.pieces = []
