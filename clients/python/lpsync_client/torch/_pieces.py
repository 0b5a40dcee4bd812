"""Tensors of any size: a message larger than one daemon buffer (``--max-buffer-bytes``)
travels as several collectives over consecutive element ranges, issued in the same order
on every rank (collectives are matched by sequence number).

The daemon does not announce its limit at attach; it names it when it refuses a buffer
(RESOURCE_EXHAUSTED: "... exceeds the daemon's limit of N bytes (--max-buffer-bytes)").
``learn`` keeps that number per client, so the refused allocation is made again in pieces
and later ones are cut at once. Every rank attached to one daemon learns the same limit
from the same refusal, hence cuts the same pieces.

``bounds`` is the one rule every split follows (the backend's operations, the DDP hook,
DistributedOptimizer); ``Pieced`` is a flat buffer made of such pieces, in shared memory
or, for device tensors on the device path, in their device's memory.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from lpsync_client import _adapt
from lpsync_client.client import Client
from lpsync_client.errors import ResourceExhaustedError
from lpsync_client.torch._client import Where, empty_on

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
    """``numel`` elements of ``dtype`` registered once, as consecutive buffers each within
    the daemon's buffer limit (one when the whole fits); collectives run one per buffer,
    in order. The buffers are shared memory, or device memory on ``where`` (registered by
    IPC handle: copies in and out stay on the device)."""

    def __init__(self, client: Client, numel: int, dtype: torch.dtype, where: Where | None = None) -> None:
        # (An empty buffer has no device memory to register: shared memory, moving nothing.)
        self.client, self.numel, self.dtype = client, numel, dtype
        self.where = where if numel else None
        # (first element, what the client takes, torch view of it, what release() gives back)
        self.pieces: list[tuple[int, object, torch.Tensor, object]] = []
        while True:
            limit = buffer_limit(client)
            try:
                per_piece = numel if limit is None else limit // dtype.itemsize
                for start, stop in list(bounds(numel, per_piece)) or [(0, 0)]:  # even empty: one
                    self.pieces.append((start, *self._buffer(stop - start)))
                return
            except ResourceExhaustedError as error:
                self.release()
                if not learn(client, error):
                    raise

    def _buffer(self, count: int) -> tuple[object, torch.Tensor, object]:
        if self.where is None:
            array = self.client.empty(count * self.dtype.itemsize, "uint8")
            view = torch.from_numpy(array).view(self.dtype)
            return (view if self.dtype not in _NUMPY else array.view(_NUMPY[self.dtype])), view, array
        view = empty_on(self.where, count, self.dtype)
        _adapt.ensure_registered(self.client, view)  # for as long as the view lives: ours
        return view, view, view

    def spans(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first element, view of the buffer) covering elements [start, stop), in order."""
        for first, _, view, _ in self.pieces:
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
        if out.is_contiguous():  # piece by piece into it: no gathered temporary
            flat = out.view(-1)
            for lo, view in self.spans(start, start + out.numel()):
                flat[lo - start : lo - start + view.numel()].copy_(view)
            return
        parts = [view for _, view in self.spans(start, start + out.numel())]
        out.copy_((parts[0] if len(parts) == 1 else torch.cat(parts)).view(out.shape))

    def allreduce_async(self, op: str, timeout: float | None, name: str) -> Future:
        """One allreduce per piece, in order; a future completed when all are."""
        several = len(self.pieces) > 1
        return all_done(
            [
                self.client.allreduce_async(
                    operand, op=op, timeout=timeout, name=f"{name}/piece{i}" if several else name
                )
                for i, (_, operand, _, _) in enumerate(self.pieces)
            ]
        )

    def release(self) -> None:
        for _, _, _, owned in self.pieces:
            self.client.release(owned)
        self.pieces = []
