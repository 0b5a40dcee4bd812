"""The calls Horovod users expect: allreduce, broadcast, and broadcasting a model's and an
optimizer's state from one rank (so every rank starts from the same point)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from lpsync_client import _adapt
from lpsync_client.client import Client
from lpsync_client.errors import InvalidArgumentError
from lpsync_client.torch._client import host_view, resolve

# torch dtypes the daemon has no name for, carried as bytes of the same width (broadcast
# only: reducing them would be meaningless).
_AS_BITS = {torch.bool: torch.uint8}


def allreduce(
    tensor: torch.Tensor,
    op: str = "avg",
    *,
    client: Client | None = None,
    name: str = "",
    timeout: float | None = None,
) -> torch.Tensor:
    """A new tensor holding ``tensor`` reduced over every rank (op: avg, sum, prod, min,
    max); ``tensor`` is not modified. Blocks until done.

    >>> mean_loss = lpt.allreduce(loss.detach(), op="avg")
    """
    return allreduce_(tensor.detach().clone(), op, client=client, name=name, timeout=timeout)


def allreduce_(
    tensor: torch.Tensor,
    op: str = "avg",
    *,
    client: Client | None = None,
    name: str = "",
    timeout: float | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over every rank in place; returns it. A CUDA tensor runs on the
    daemon's GPU streams when it serves cuda (ordered after the current stream)."""
    client = resolve(client)
    if _on_device(client, tensor):
        _adapt.ensure_registered(client, tensor)
        client.allreduce(tensor.detach(), op=op, name=name, timeout=timeout)
        return tensor
    host = host_view(tensor)
    client.allreduce(host, op=op, name=name, timeout=timeout)
    _write_back(tensor, host)
    return tensor


def broadcast(
    tensor: torch.Tensor,
    root: int = 0,
    *,
    client: Client | None = None,
    name: str = "",
    timeout: float | None = None,
) -> torch.Tensor:
    """Overwrite ``tensor`` with root's (in place, every rank); returns it."""
    client = resolve(client)
    if _on_device(client, tensor):
        bits = tensor.detach()
        bits = bits.view(_AS_BITS[bits.dtype]) if bits.dtype in _AS_BITS else bits
        _adapt.ensure_registered(client, bits)
        client.broadcast(bits, root=root, name=name, timeout=timeout)
        return tensor
    host = host_view(tensor)
    bits = host.view(_AS_BITS[host.dtype]) if host.dtype in _AS_BITS else host
    client.broadcast(bits, root=root, name=name, timeout=timeout)
    _write_back(tensor, host)
    return tensor


def _on_device(client: Client, tensor: torch.Tensor) -> bool:
    """The device path: a contiguous CUDA tensor, a daemon serving cuda."""
    return tensor.device.type == "cuda" and tensor.is_contiguous() and _adapt.on_device_path(client, tensor)


def _write_back(tensor: torch.Tensor, host: torch.Tensor) -> None:
    if host.data_ptr() != tensor.data_ptr() or host.device != tensor.device:
        with torch.no_grad():
            tensor.copy_(host)


def _tensors(source: object) -> list[torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        return list(source.state_dict().values())
    if isinstance(source, Mapping):
        return [t for t in source.values() if isinstance(t, torch.Tensor)]
    if isinstance(source, Iterable):
        items = list(source)
        return [t[1] if isinstance(t, tuple) else t for t in items]
    raise InvalidArgumentError(
        "broadcast_parameters takes a module, a state_dict, named_parameters() or an iterable of tensors"
    )


def broadcast_parameters(
    params: object, root: int = 0, *, client: Client | None = None, timeout: float | None = None
) -> None:
    """Overwrite every tensor of ``params`` (a module, its state_dict(), named_parameters()
    or tensors; the same structure on every rank) with root's, in place. One fused
    broadcast per dtype, not one per tensor.

    >>> lpt.broadcast_parameters(model.state_dict(), root=0)
    """
    client = resolve(client)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in _tensors(params):
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        flat = torch.cat([host_view(t).reshape(-1) for t in group])
        broadcast(
            flat,
            root,
            client=client,
            timeout=timeout,
            name=f"broadcast_parameters/{str(dtype).removeprefix('torch.')}",
        )
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root: int = 0,
    *,
    client: Client | None = None,
    timeout: float | None = None,
) -> None:
    """Load root's optimizer state (moments, step counts, hyperparameters) on every rank.
    The optimizers must hold the same parameter groups; ranks whose state is still empty
    (before the first step) are fine: the state travels as one serialized blob.

    >>> lpt.broadcast_optimizer_state(optimizer, root=0)
    """
    client = resolve(client)
    blob = np.zeros(0, np.uint8)
    if client.rank == root:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        blob = np.frombuffer(buffer.getbuffer(), np.uint8).copy()
    size = np.array([blob.size], np.int64)
    client.broadcast(size, root=root, timeout=timeout, name="broadcast_optimizer_state/size")
    if client.rank != root:
        blob = np.zeros(int(size[0]), np.uint8)
    client.broadcast(blob, root=root, timeout=timeout, name="broadcast_optimizer_state")
    if client.rank != root:
        state = torch.load(io.BytesIO(blob.tobytes()), weights_only=True)
        optimizer.load_state_dict(state)
