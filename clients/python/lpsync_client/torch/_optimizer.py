"""DistributedOptimizer: data-parallel training without DDP, as Horovod's. Gradients are
fused into buckets of about ``bucket_bytes`` (25 MiB, DDP's and Horovod's default), each
bucket a buffer registered once: on the parameters' device when the daemon serves it
(device memory by IPC handle, gradients copied in and out on the device), else in shared
memory; a bucket is averaged through the daemon as soon as its last gradient has been
accumulated during backward, and ``step()`` waits for them all before the wrapped
optimizer's step.

    opt = lpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import cast

import torch

from lpsync_client.client import Client
from lpsync_client.errors import InvalidArgumentError
from lpsync_client.torch._client import empty_on, on_device_path, resolve
from lpsync_client.torch._pieces import Pieced

DEFAULT_BUCKET_BYTES = 25 << 20
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16"}


class _Bucket:
    """Parameters whose gradients travel together, in one buffer (in pieces where it
    exceeds the daemon's buffer limit), on their device when they share one the daemon
    serves."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], client: Client) -> None:
        self.index, self.params = index, params
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        places = {on_device_path(client, p) for p in params}
        self.buffer = Pieced(client, total, params[0].dtype, places.pop() if len(places) == 1 else None)
        self.copied: set[int] = set()  # positions in params whose gradient is in the buffer
        self.future: Future | None = None
        self.started = 0.0

    def copy_in(self, position: int) -> None:
        p, start = self.params[position], self.offsets[position]
        if p.grad is None:  # unused in this step on this rank: contributes zeros
            self.buffer.zero(start, start + p.numel())
        else:
            self.buffer.write(start, p.grad)
        self.copied.add(position)

    def copy_out(self, position: int) -> None:
        """The averaged gradient into ``p.grad``."""
        p = self.params[position]
        if p.grad is None:  # on the buffer's device (an emulated tensor's empty_like is host)
            where = self.buffer.where
            p.grad = (
                torch.empty_like(p) if where is None else empty_on(where, p.numel(), p.dtype).view(p.shape)
            )
        self.buffer.read(self.offsets[position], p.grad)

    @property
    def ready(self) -> bool:
        return len(self.copied) == len(self.params)


class _Distributed:
    """Mixed in before the wrapped optimizer's class (isinstance and lr schedulers keep
    working); the instance shares the wrapped optimizer's param_groups and state."""

    _lpsync_buckets: list[_Bucket]

    def _lpsync_init(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        client: Client,
        bucket_bytes: int,
        op: str,
        timeout: float | None,
    ) -> None:
        self._lpsync_client, self._lpsync_op, self._lpsync_timeout = client, op, timeout
        self._lpsync_lock = threading.Lock()
        self._lpsync_next = 0  # buckets are launched in index order on every rank
        self.comm_seconds = 0.0
        # Gradients arrive roughly in reverse order of definition: bucket from the end.
        buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for _, p in reversed(named):
            if current and (
                p.dtype != current[0].dtype or size + p.numel() * p.element_size() > bucket_bytes
            ):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(current)
        self._lpsync_buckets = [_Bucket(i, ps, client) for i, ps in enumerate(buckets)]
        self._lpsync_where: dict[int, tuple[_Bucket, int]] = {}
        self._lpsync_handles = []
        for bucket in self._lpsync_buckets:
            for position, p in enumerate(bucket.params):
                self._lpsync_where[id(p)] = (bucket, position)
                self._lpsync_handles.append(p.register_post_accumulate_grad_hook(self._lpsync_ready))

    # -- during backward -------------------------------------------------------------------
    def _lpsync_ready(self, p: torch.Tensor) -> None:
        bucket, position = self._lpsync_where[id(p)]
        with self._lpsync_lock:
            if bucket.future is not None:
                raise InvalidArgumentError(
                    "a gradient was accumulated twice before step(): call step() (or "
                    "synchronize()) after each backward"
                )
            bucket.copy_in(position)
            self._lpsync_launch(force=False)

    def _lpsync_launch(self, force: bool) -> None:
        """Start every bucket that is ready (all of them when ``force``), in index order."""
        while self._lpsync_next < len(self._lpsync_buckets):
            bucket = self._lpsync_buckets[self._lpsync_next]
            if not bucket.ready:
                if not force:
                    return
                for position in range(len(bucket.params)):
                    if position not in bucket.copied:
                        bucket.copy_in(position)
            bucket.started = time.perf_counter()
            bucket.future = bucket.buffer.allreduce_async(
                self._lpsync_op, self._lpsync_timeout, f"optimizer/bucket{bucket.index}"
            )
            self._lpsync_next += 1

    # -- public ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish averaging every gradient (started during backward) and write the averages
        into ``p.grad``. ``step()`` calls it."""
        with self._lpsync_lock:
            self._lpsync_launch(force=True)
            buckets, self._lpsync_next = self._lpsync_buckets, 0
        try:
            for bucket in buckets:
                assert bucket.future is not None
                bucket.future.result()
                self.comm_seconds += time.perf_counter() - bucket.started
                with torch.no_grad():
                    for position in range(len(bucket.params)):
                        bucket.copy_out(position)
        finally:
            for bucket in buckets:
                bucket.future, bucket.copied = None, set()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.synchronize()
        # The made class's next base is the wrapped optimizer's class, which a mixin cannot name.
        return super().step(closure)  # type: ignore[misc]

    def remove_hooks(self) -> None:
        """Stop watching the gradients (the buffers are freed when the client closes)."""
        for handle in self._lpsync_handles:
            handle.remove()
        self._lpsync_handles = []


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    op: str = "avg",
    client: Client | None = None,
    timeout: float | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    ``named_parameters`` (default: the optimizer's parameters) fixes the bucketing and must
    list the same parameters in the same order on every rank. ``bucket_bytes`` caps a
    fused bucket. Use the returned optimizer instead of ``optimizer``.
    """
    if bucket_bytes <= 0:
        raise InvalidArgumentError("bucket_bytes must be positive")
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if named_parameters is None:
        named = [
            (f"param{i}", p) for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        ]
    else:
        named = list(named_parameters)
    seen: set[int] = set()
    chosen = []
    for name, p in named:
        if id(p) in seen or not p.requires_grad or id(p) not in in_optimizer:
            continue
        if p.dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"parameter {name}: dtype {p.dtype} is not supported "
                f"(use one of {', '.join(map(str, _DTYPES))})"
            )
        seen.add(id(p))
        chosen.append((name, p))
    cls = type(optimizer)
    wrapped_cls = cast(type[_Distributed], type(f"Distributed{cls.__name__}", (_Distributed, cls), {}))
    wrapped = wrapped_cls.__new__(wrapped_cls)
    wrapped.__dict__.update(optimizer.__dict__)  # same param_groups, state and hooks
    wrapped._lpsync_init(chosen, resolve(client), bucket_bytes, op, timeout)
    return cast(torch.optim.Optimizer, wrapped)  # an instance of cls too
