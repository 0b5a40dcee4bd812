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
from lpsync_client.torch._client import Where, empty_on, host_view, on_device_path, resolve

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
    """Reduce ``tensor`` over every rank in place; returns it. A contiguous CUDA tensor
    runs on the daemon's GPU streams when it serves cuda (ordered after the current stream)."""
    client = resolve(client)
    device = _device_operand(client, tensor)
    if device is not None:
        client.allreduce(device[1], op=op, name=name, timeout=timeout)
        _write_back(tensor, device[0])
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
    device = _device_operand(client, tensor)
    if device is not None:
        client.broadcast(device[1], root=root, name=name, timeout=timeout)
        _write_back(tensor, device[0])
        return tensor
    host = host_view(tensor)
    client.broadcast(_bits(host), root=root, name=name, timeout=timeout)
    _write_back(tensor, host)
    return tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_AS_BITS[t.dtype]) if t.dtype in _AS_BITS else t


def _device_operand(client: Client, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device path, for a device tensor of a kind the daemon serves: (the tensor, or a
    contiguous copy on its device when it is strided; what the client takes: the same, or
    its bits for bool). None off the device path (staged through host memory)."""
    if on_device_path(client, tensor) is None:
        return None
    flat = tensor if tensor.is_contiguous() else _pack(client, [tensor])
    operand = _bits(flat.detach())
    # Registered weakly, for as long as the object it is tied to lives: the tensor itself
    # where it can be described, else the operand (for this call).
    _adapt.ensure_registered(client, flat if operand.dtype == flat.dtype else operand)
    return flat, operand


def _write_back(tensor: torch.Tensor, result: torch.Tensor) -> None:
    if result.data_ptr() != tensor.data_ptr() or result.device != tensor.device:
        with torch.no_grad():
            tensor.copy_(result.view(tensor.shape))


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
        flat = _pack(client, group)
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


def _pack(client: Client, group: list[torch.Tensor]) -> torch.Tensor:
    """``group`` (one dtype) as one flat tensor: built on their device when they all live
    on one the daemon serves (no host copy), else in host memory."""
    places = {on_device_path(client, t) for t in group}
    where: Where | None = places.pop() if len(places) == 1 else None
    if where is None:
        return torch.cat([host_view(t).reshape(-1) for t in group])
    flat = empty_on(where, sum(t.numel() for t in group), group[0].dtype)
    offset = 0
    with torch.no_grad():
        for t in group:
            flat[offset : offset + t.numel()].view(t.shape).copy_(t)  # strides as they are
            offset += t.numel()
    return flat


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
