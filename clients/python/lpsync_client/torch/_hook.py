"""The DDP communication hook: each gradient bucket is averaged through the daemon as soon
as DDP hands it over, so the collectives of earlier buckets run while backward computes
later gradients.

    model.register_comm_hook(lpt.hook_state(), lpt.allreduce_hook)
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import threading
import time
from concurrent.futures import Future as ClientFuture

import torch
import torch.distributed as dist

from lpsync_client.client import Client
from lpsync_client.torch._client import note_device, resolve
from lpsync_client.torch._pieces import Pieced

# Bucket dtypes the hook reduces as they are; any other is carried as float32.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class HookState:
    """What the hook keeps between steps: the client, one shared-memory buffer per bucket
    (registered once, reused every step; replaced when DDP rebuilds its buckets after the
    first iteration; in pieces when a bucket exceeds the daemon's buffer limit) and the
    time spent in communication."""

    def __init__(self, client: Client, op: str = "avg", timeout: float | None = None) -> None:
        self.client, self.op, self.timeout = client, op, timeout
        self._buffers: dict[int, Pieced] = {}  # by bucket index
        self._lock = threading.Lock()  # guards the counters (written by the completion thread)
        self.comm_seconds = 0.0  # submit -> completion, summed over buckets (may overlap backward)
        self.collectives = 0
        self.bytes = 0
        self.replaced = 0  # bucket buffers given back because DDP rebuilt its buckets

    def buffer(self, index: int, like: torch.Tensor) -> Pieced:
        """The shared-memory buffer of bucket ``index``, sized and typed like ``like``."""
        dtype = like.dtype if like.dtype in _DTYPES else torch.float32
        held = self._buffers.get(index)
        if held is not None and held.numel == like.numel() and held.dtype == dtype:
            return held
        if held is not None:  # DDP rebuilt its buckets: this index now holds other gradients
            held.release()
            self.replaced += 1
        self._buffers[index] = Pieced(self.client, like.numel(), dtype)
        return self._buffers[index]

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
        for held in self._buffers.values():
            held.release()
        self._buffers.clear()


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
    buffer = state.buffer(bucket.index(), gradients)
    note_device(gradients)
    buffer.write(0, gradients)  # from any device into shared memory; copied back on completion
    # The outcome travels as a value and is raised in a then() callback: DDP's C++ side
    # reads an exception put with Future.set_exception as a value ("Unable to cast").
    outcome: torch.futures.Future = torch.futures.Future()
    result = outcome.then(_unwrap)
    started = time.perf_counter()
    try:
        # One allreduce per piece where the bucket exceeds the daemon's buffer limit.
        pending = buffer.allreduce_async(state.op, state.timeout, f"ddp/bucket{bucket.index()}")
    except BaseException as error:
        outcome.set_result(error)
        return result

    def done(finished: ClientFuture) -> None:
        try:
            finished.result()
            # Safe from this thread: autograd wrote this bucket's gradients before DDP
            # called the hook and touches them again only after the Future completes.
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
