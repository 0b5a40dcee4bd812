"""The torch adapter's client, where a tensor's memory is, and host staging."""

from __future__ import annotations

import logging

import torch

from lpsync_client import _adapt, emulated
from lpsync_client._default import default_client, resolve, set_default_client
from lpsync_client._device import emulated_span
from lpsync_client.client import Client

__all__ = [
    "Where",
    "default_client",
    "device_of",
    "empty_on",
    "host_view",
    "note_device",
    "on_device_path",
    "resolve",
    "set_default_client",
]

_log = logging.getLogger("lpsync_client.torch")
_warned_device = False

# The device memory a tensor lives in: ("cuda", ordinal) or ("emulated", device).
Where = tuple[str, int]


def device_of(tensor: torch.Tensor) -> Where | None:
    """Where ``tensor``'s memory is: a CUDA device, an emulated device (a CPU tensor over
    lpsync_client.emulated memory, the CI stand-in for a CUDA tensor), or None for host
    memory (and sparse tensors, whose collectives are staged)."""
    if tensor.is_sparse:
        return None
    if tensor.device.type == "cuda":
        index = tensor.device.index
        return "cuda", torch.cuda.current_device() if index is None else index
    found = emulated_span(tensor)
    return None if found is None else ("emulated", found[0].device)


def on_device_path(client: Client, tensor: torch.Tensor) -> Where | None:
    """``tensor``'s device when the client's daemon serves its memory kind: then its
    collectives run on device buffers (docs/gpu.md, "Framework adapters")."""
    where = device_of(tensor)
    return where if where is not None and where[0] in _adapt.served_kinds(client) else None


def empty_on(where: Where, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat uninitialised tensor of ``count`` elements in ``where``'s device memory."""
    kind, index = where
    if kind == "cuda":
        return torch.empty(count, dtype=dtype, device=f"cuda:{index}")
    return emulated.tensor(count, dtype, index)


def note_device(tensor: torch.Tensor) -> None:
    """Log once that device tensors take the staged slow path."""
    global _warned_device
    where = None if _warned_device else device_of(tensor)
    if where is not None:
        _warned_device = True
        _log.warning(
            "lpsync: %s tensors are staged through host memory here (the daemon "
            "serves no such devices, or this call has no device path yet)",
            where[0],
        )


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor in host memory for ``tensor``: itself when it already is one,
    else a staged copy (the slow path of device tensors off the device path: logged once)."""
    if tensor.device.type != "cpu" or device_of(tensor) is not None:
        note_device(tensor)
        return tensor.detach().to("cpu", copy=True).contiguous()
    return tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
