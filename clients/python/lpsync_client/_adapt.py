"""The framework adapters' device path (torch, cupy, jax): which arrays take it, and how.

A device array (a CUDA tensor or array, an lpsync_client.emulated array, or a torch
tensor in emulated memory: the CI stand-in for a CUDA tensor) goes to the daemon as a
device buffer when the daemon serves its memory kind (`lpsync daemon --devices cuda:...`
/ `emulated:N`, read once per client from its status); otherwise the adapter stages it
through host memory as before. On the device path:
  * the array is registered once per allocation span (the client's registrations are
    looked up by span, Client._device) with ``hold=False``: the registration does not keep
    the array alive, only its memory (so the allocator cannot free it while the daemon maps
    it), and is released by the client's reaper thread once the array is collected (or
    when the client closes);
  * the collective runs on the array itself: the client records its interprocess event on
    the framework's current stream (the daemon's streams wait on it) and the call returns
    once the daemon's streams finished, so work queued afterwards sees the result.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

from lpsync_client._device import emulated_span, is_device_array
from lpsync_client.client import Client, DeviceRegistered
from lpsync_client.errors import LpsyncError

_served: weakref.WeakKeyDictionary[Client, frozenset[str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def served_kinds(client: Client) -> frozenset[str]:
    """The memory kinds the client's daemon serves besides host memory (cached)."""
    with _lock:
        kinds = _served.get(client)
    if kinds is None:
        kinds = frozenset(d.kind for d in client.status().devices)
        with _lock:
            _served[client] = kinds
    return kinds


def kind_of(x: object) -> str | None:
    """ "emulated", "cuda", or None for host memory."""
    if hasattr(x, "__lpsync_device__") or emulated_span(x) is not None:
        return "emulated"
    return "cuda" if is_device_array(x) else None


def on_device_path(client: Client, x: object) -> bool:
    """Whether ``x`` runs as a device buffer (a device array of a kind the daemon serves)."""
    kind = kind_of(x)
    return kind is not None and kind in served_kinds(client)


def ensure_registered(client: Client, x: object) -> DeviceRegistered | None:
    """Register ``x``'s span unless a registration covers it already (hold=False): see
    Client.ensure_registered."""
    return client.ensure_registered(x)


def allreduce_arrays(
    client: Client, arrays: Sequence[object], op: str, *, name: str = "", timeout: float | None = None
) -> None:
    """Reduce every device array in place, one collective each (all submitted, then
    awaited: the daemon pipelines them)."""
    futures: list[Future] = []
    held = []
    try:
        for i, a in enumerate(arrays):
            made = ensure_registered(client, a)
            if made is not None:
                held.append(made)
            futures.append(
                client.allreduce_async(a, op=op, timeout=timeout, name=f"{name}/{i}" if name else "")
            )
        for future in futures:
            client._wait(future, timeout)
    finally:
        for registered in held:
            with contextlib.suppress(LpsyncError):
                client.release(registered)
