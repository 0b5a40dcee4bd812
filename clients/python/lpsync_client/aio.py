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
import inspect
from collections.abc import Callable
from typing import Any

from lpsync_client import _ops
from lpsync_client import client as _sync


def _awaitable(name: str) -> Callable[..., asyncio.Future]:
    """Collective ``name`` as an asyncio Future: the sync client's ``<name>_async``, its
    parameters and the table's docstring."""
    start = getattr(_sync.Client, f"{name}_async")

    def call(self: Any, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.wrap_future(getattr(self.sync, start.__name__)(*args, **kwargs))

    call.__name__, call.__qualname__ = name, f"Client.{name}"
    call.__doc__ = inspect.cleandoc(_ops.OPS[name].doc)
    call.__signature__ = inspect.signature(start).replace(return_annotation="asyncio.Future")  # type: ignore[attr-defined]
    return call


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

    # The collectives of lpsync_client.Client (_ops.OPS), each submitted at once.
    allreduce = _awaitable("allreduce")
    broadcast = _awaitable("broadcast")
    reduce = _awaitable("reduce")
    allgather = _awaitable("allgather")
    reduce_scatter = _awaitable("reduce_scatter")
    gather = _awaitable("gather")
    scatter = _awaitable("scatter")
    alltoall = _awaitable("alltoall")
    barrier = _awaitable("barrier")

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
