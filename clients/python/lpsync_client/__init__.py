"""lpsync_client: attach to the node's lpsync daemon and run collectives over shared memory.

    import lpsync_client
    with lpsync_client.connect() as client:   # env: LPSYNC_SOCKET, LPSYNC_JOB, RANK, WORLD_SIZE
        x = client.zeros(1024, "float32")
        x[:] = client.rank
        client.allreduce(x)                    # x == sum of ranks, on every rank

Blocking calls: allreduce, broadcast, reduce, allgather, reduce_scatter, gather, scatter,
alltoall, barrier; each has an ``*_async`` twin returning a concurrent.futures.Future.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lpsync_client.errors import (
    AbortedError,
    AlreadyExistsError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    NotFoundError,
    ResourceExhaustedError,
    TimeoutError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from lpsync_client.wire import DEFAULT_SOCKET

if TYPE_CHECKING:
    from lpsync_client.client import Client, DeviceRegistered, Registered, connect

_CLIENT = frozenset({"Client", "DeviceRegistered", "Registered", "connect"})


def __getattr__(name: str) -> Any:
    """The client's names, imported on first use: the daemon imports this package for its
    contract (wire, errors, futex) and needs neither numpy nor grpc for that."""
    if name in _CLIENT or name == "client":
        client = importlib.import_module("lpsync_client.client")  # (a from-import would ask here again)
        return client if name == "client" else getattr(client, name)
    raise AttributeError(f"module 'lpsync_client' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = [
    "DEFAULT_SOCKET",
    "AbortedError",
    "AlreadyExistsError",
    "Client",
    "CollectiveTimeoutError",
    "DeviceRegistered",
    "InvalidArgumentError",
    "LpsyncError",
    "MismatchError",
    "NotFoundError",
    "Registered",
    "ResourceExhaustedError",
    "TimeoutError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "connect",
]


def __dir__() -> list[str]:
    return sorted({*globals(), *_CLIENT})
