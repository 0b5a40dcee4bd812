"""The DDP communication hook: each gradient bucket is averaged through the daemon as soon
as DDP hands it over, so the collectives of earlier buckets run while backward computes
later gradients. A bucket on a device the daemon serves is reduced in DDP's own bucket
tensor, registered by IPC handle (no copy at all); other buckets go through a buffer
registered once per bucket: on their device (device to device copies) when they are
device tensors, else in shared memory.

    model.register_comm_hook(lpt.hook_state(), lpt.allreduce_hook)
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import contextlib
import threading
import time
from concurrent.futures import Future as ClientFuture

import torch
import torch.distributed as dist

from lpsync_client import _adapt
from lpsync_client.client import Client
from lpsync_client.errors import LpsyncError, ResourceExhaustedError
from lpsync_client.torch._client import note_device, on_device_path, resolve
from lpsync_client.torch._pieces import Pieced, buffer_limit, learn

# Bucket dtypes the hook reduces as they are; any other is carried as float32.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class HookState:
    """What the hook keeps between steps: the client, per bucket either DDP's bucket tensor
    itself (on the device path: registered once, kept so that its registration lives) or a
    buffer registered once (in pieces when a bucket exceeds the daemon's buffer limit);
    either is replaced when DDP rebuilds its buckets after the first iteration. And the
    time spent in communication."""

    def __init__(self, client: Client, op: str = "avg", timeout: float | None = None) -> None:
        self.client, self.op, self.timeout = client, op, timeout
        self._buffers: dict[int, Pieced] = {}  # by bucket index
        self._in_place: dict[int, torch.Tensor] = {}  # by bucket index: DDP's own, registered
        self._lock = threading.Lock()  # guards the counters (written by the completion thread)
        self.comm_seconds = 0.0  # submit -> completion, summed over buckets (may overlap backward)
        self.collectives = 0
        self.bytes = 0
        self.replaced = 0  # bucket buffers given back because DDP rebuilt its buckets

    def in_place(self, index: int, gradients: torch.Tensor) -> bool:
        """Whether bucket ``index`` is reduced in ``gradients`` itself: a contiguous device
        tensor of a dtype reduced as it is, within the daemon's buffer limit, on a daemon
        serving its kind. Registered at its first step (the registration lives while the
        state keeps the tensor)."""
        held = self._in_place.get(index)
        if held is not None and _same(held, gradients):
            return True
        if held is not None:  # DDP rebuilt its buckets: this index now holds other gradients
            self._drop(index)
        if not (
            gradients.dtype in _DTYPES
            and gradients.is_contiguous()
            and on_device_path(self.client, gradients) is not None
        ):
            return False
        limit = buffer_limit(self.client)
        if limit is not None and gradients.numel() * gradients.element_size() > limit:
            return False  # reduced in pieces of a device buffer instead
        try:
            _adapt.ensure_registered(self.client, gradients)
        except ResourceExhaustedError as error:
            if learn(self.client, error):
                return False
            raise
        if index in self._buffers:
            self._drop(index)
        self._in_place[index] = gradients
        return True

    def buffer(self, index: int, like: torch.Tensor) -> Pieced:
        """The buffer of bucket ``index``, sized and typed like ``like``: on its device when
        the daemon serves it, else in shared memory."""
        dtype = like.dtype if like.dtype in _DTYPES else torch.float32
        where = on_device_path(self.client, like) if like.numel() else None  # (as Pieced keeps it)
        held = self._buffers.get(index)
        if held is not None and (held.numel, held.dtype, held.where) == (like.numel(), dtype, where):
            return held
        if held is not None or index in self._in_place:  # DDP rebuilt its buckets
            self._drop(index)
        self._buffers[index] = Pieced(self.client, like.numel(), dtype, where)
        return self._buffers[index]

    def _drop(self, index: int, replaced: bool = True) -> None:
        """Give back what bucket ``index`` held (``replaced``: DDP rebuilt its buckets)."""
        held = self._buffers.pop(index, None)
        if held is not None:
            held.release()
        tensor = self._in_place.pop(index, None)
        if tensor is not None:
            with contextlib.suppress(LpsyncError):  # (released already: the client closed)
                self.client.release(tensor)
        self.replaced += replaced

    def take_stats(self) -> tuple[float, int, int]:
        """(communication seconds, collectives, bytes) since the last call; resets them."""
        with self._lock:
            stats = (self.comm_seconds, self.collectives, self.bytes)
            self.comm_seconds, self.collectives, self.bytes = 0.0, 0, 0
        return stats

    def _record(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.comm_seconds += seconds
            self.collectives += 1
            self.bytes += nbytes

    def release(self) -> None:
        """Give the bucket buffers back to the daemon (the client stays attached)."""
        for index in [*self._buffers, *self._in_place]:
            self._drop(index, replaced=False)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory, shape and dtype (DDP hands a bucket's tensor anew each step)."""
    return (a.data_ptr(), a.numel(), a.dtype, a.device) == (b.data_ptr(), b.numel(), b.dtype, b.device)


def hook_state(client: Client | None = None, *, op: str = "avg", timeout: float | None = None) -> HookState:
    """The state for :func:`allreduce_hook`, attached from torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, LPSYNC_SOCKET, LPSYNC_JOB) unless ``client``
    is given. ``op`` "avg" averages as DDP's default hook does; ``timeout`` bounds each
    bucket's collective (default: the client's)."""
    return HookState(resolve(client), op, timeout)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket over every rank through lpsync. Returns at once;
    the Future completes from the client's completion thread."""
    gradients = bucket.buffer()
    index, name = bucket.index(), f"ddp/bucket{bucket.index()}"
    # The outcome travels as a value and is raised in a then() callback: DDP's C++ side
    # reads an exception put with Future.set_exception as a value ("Unable to cast").
    outcome: torch.futures.Future = torch.futures.Future()
    result = outcome.then(_unwrap)
    started = time.perf_counter()
    buffer: Pieced | None = None  # None: reduced in DDP's own bucket tensor
    if not state.in_place(index, gradients):
        buffer = state.buffer(index, gradients)
        if buffer.where is None:
            note_device(gradients)
        buffer.write(0, gradients)  # into the buffer; copied back on completion
    try:
        if buffer is None:
            pending = state.client.allreduce_async(
                gradients.detach(), op=state.op, timeout=state.timeout, name=name
            )
        else:  # one allreduce per piece where the bucket exceeds the daemon's buffer limit
            pending = buffer.allreduce_async(state.op, state.timeout, name)
    except BaseException as error:
        outcome.set_result(error)
        return result

    def done(finished: ClientFuture) -> None:
        try:
            finished.result()
            # Safe from this thread: autograd wrote this bucket's gradients before DDP
            # called the hook and touches them again only after the Future completes.
            if buffer is not None:
                with torch.no_grad():
                    buffer.read(0, gradients)
            state._record(time.perf_counter() - started, gradients.numel() * gradients.element_size())
            outcome.set_result(gradients)
        except BaseException as error:
            outcome.set_result(error)

    pending.add_done_callback(done)
    return result


def _unwrap(outcome: torch.futures.Future) -> torch.Tensor:
    value = outcome.value()
    if isinstance(value, BaseException):
        raise value
    return value
