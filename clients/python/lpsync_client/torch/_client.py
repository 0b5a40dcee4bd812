"""The process's client for the torch adapter: one attachment per process, made from the
environment on first use unless the caller passes or sets one."""

from __future__ import annotations

import atexit
import logging
import threading

import torch

from lpsync_client.client import Client, connect

_log = logging.getLogger("lpsync_client.torch")
_lock = threading.Lock()
_default: Client | None = None
_warned_device = False


def default_client() -> Client:
    """The client every call without ``client=`` uses: ``lpsync_client.connect()`` from the
    environment on first use (closed at exit)."""
    global _default
    with _lock:
        if _default is None:
            _default = connect()
            atexit.register(_default.close)
        return _default


def set_default_client(client: Client | None) -> None:
    """Use ``client`` for calls without ``client=`` (None: connect from the environment
    again on next use). The caller keeps ownership: it is not closed at exit."""
    global _default
    with _lock:
        _default = client


def resolve(client: Client | None) -> Client:
    return client if client is not None else default_client()


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor for ``tensor``: itself when it already is one, else a staged
    copy (a slow path for CUDA tensors until the daemon maps device memory: logged once)."""
    global _warned_device
    if tensor.device.type != "cpu":
        if not _warned_device:
            _warned_device = True
            _log.warning("lpsync: %s tensors are staged through host memory (slow path)",
                         tensor.device.type)
        return tensor.detach().to("cpu").contiguous()
    return tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
