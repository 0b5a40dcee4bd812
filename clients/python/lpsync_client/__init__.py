"""lpsync_client: attach to the node's lpsync daemon and run collectives over shared memory.

    import lpsync_client
    with lpsync_client.connect() as client:   # env: LPSYNC_SOCKET, LPSYNC_JOB, RANK, WORLD_SIZE
        x = client.zeros(1024, "float32")
        x[:] = client.rank
        client.allreduce(x)                    # x == sum of ranks, on every rank

Blocking calls: allreduce, broadcast, reduce, allgather, reduce_scatter, gather, scatter,
alltoall, barrier; each has an ``*_async`` twin returning a concurrent.futures.Future.
"""

from lpsync_client.client import Client, DeviceRegistered, Registered, connect
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
