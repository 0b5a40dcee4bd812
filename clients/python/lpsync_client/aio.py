"""asyncio twin of lpsync_client: the same names, awaitable.

    import lpsync_client.aio as lpsync
    async with await lpsync.connect(job="demo", rank=0, world_size=2) as client:
        x = client.zeros(1024)
        await client.allreduce(x)

Each collective is submitted when it is called (so collectives keep the order of the
calls, as matching requires) and returns an asyncio Future to await; nothing blocks the
event loop. Buffers (empty, zeros, register, release) are the sync client's.
"""

from __future__ import annotations

import asyncio
import functools

from lpsync_client import client as _sync


class Client:
    """Wraps a connected lpsync_client.Client; see its methods for the parameters."""

    def __init__(self, client: _sync.Client) -> None:
        self.sync = client
        self.rank, self.world_size, self.job = client.rank, client.world_size, client.job

    def empty(self, *args, **kwargs):
        return self.sync.empty(*args, **kwargs)

    def zeros(self, *args, **kwargs):
        return self.sync.zeros(*args, **kwargs)

    def register(self, x):
        return self.sync.register(x)

    def release(self, x) -> None:
        self.sync.release(x)

    def allreduce(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.allreduce_async(*args, **kwargs))

    def broadcast(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.broadcast_async(*args, **kwargs))

    def reduce(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.reduce_async(*args, **kwargs))

    def allgather(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.allgather_async(*args, **kwargs))

    def reduce_scatter(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.reduce_scatter_async(*args, **kwargs))

    def gather(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.gather_async(*args, **kwargs))

    def scatter(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.scatter_async(*args, **kwargs))

    def alltoall(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.alltoall_async(*args, **kwargs))

    def barrier(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.wrap_future(self.sync.barrier_async(*args, **kwargs))

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(*args, **kwargs) -> Client:
    """Like lpsync_client.connect (same arguments); attaching runs off the event loop."""
    loop = asyncio.get_running_loop()
    return Client(await loop.run_in_executor(None, functools.partial(_sync.connect, *args, **kwargs)))
