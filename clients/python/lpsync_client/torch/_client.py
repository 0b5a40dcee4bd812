"""The torch adapter's client and host staging."""

from __future__ import annotations

import logging

import torch

from lpsync_client._default import default_client, resolve, set_default_client

__all__ = ["default_client", "host_view", "note_device", "resolve", "set_default_client"]

_log = logging.getLogger("lpsync_client.torch")
_warned_device = False


def note_device(tensor: torch.Tensor) -> None:
    """Log once that non-CPU tensors take the staged slow path."""
    global _warned_device
    if tensor.device.type != "cpu" and not _warned_device:
        _warned_device = True
        _log.warning(
            "lpsync: %s tensors are staged through host memory here (the daemon "
            "serves no such devices, or this call has no device path yet)",
            tensor.device.type,
        )


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor for ``tensor``: itself when it already is one, else a staged
    copy (the slow path of CUDA tensors off the device path: logged once)."""
    if tensor.device.type != "cpu":
        note_device(tensor)
        return tensor.detach().to("cpu").contiguous()
    return tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
