"""The process's default client for the framework adapters (torch, jax, cupy): one
attachment per process, made from the environment on first use unless set."""

from __future__ import annotations

import atexit
import threading

from lpsync_client.client import Client, connect

_lock = threading.Lock()
_default: Client | None = None


def default_client() -> Client:
    """The client every adapter call without ``client=`` uses: ``lpsync_client.connect()``
    from the environment on first use (closed at exit)."""
    global _default
    with _lock:
        if _default is None:
            _default = connect()
            atexit.register(_default.close)
        return _default


def set_default_client(client: Client | None) -> None:
    """Use ``client`` for adapter calls without ``client=`` (None: connect from the
    environment again on next use). The caller keeps ownership: it is not closed at exit."""
    global _default
    with _lock:
        _default = client


def resolve(client: Client | None) -> Client:
    return client if client is not None else default_client()
