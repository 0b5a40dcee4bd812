"""The client's calls as one table: each op's element-count rule and its blocking twin.

Every call has an ``*_async`` method (Client: its signature, one line into ``Client._start``
or the pair jobs) and a blocking twin made here from it (``blocking``): the same
parameters, the docstring of the table, waited on the caller's thread (Client._blocking,
which answers a repeated call on that thread where it can) or, for point-to-point, on the
pair job's Future (Client._wait). ``_start``, ``_blocking`` and ``_wait`` are the hot
path's (_hot.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec

from lpsync_client.errors import InvalidArgumentError

P = ParamSpec("P")
CountOf = Callable[[int, int | None], int]  # (input elements, output elements or None) -> count


def _blocks(n: int, world_size: int, what: str) -> int:
    if n % world_size:
        raise InvalidArgumentError(f"{what} has {n} elements, not a multiple of the world size {world_size}")
    return n // world_size


def same(world_size: int, rank: int, root: int) -> CountOf:
    """One block in, one block out (allreduce, broadcast, reduce)."""

    def count(n: int, m: int | None) -> int:
        if m is not None and m != n:
            raise InvalidArgumentError(f"out has {m} elements, the input {n}")
        return n

    return count


def _gathered(op: str, world_size: int) -> CountOf:
    def count(n: int, m: int | None) -> int:
        if m is None:  # in place: x is the whole output, this rank's block at rank*count
            return _blocks(n, world_size, f"the {op} buffer")
        if m != n * world_size:
            raise InvalidArgumentError(f"out must have {n * world_size} elements")
        return n

    return count


def _scattered(op: str, world_size: int) -> CountOf:
    def count(n: int, m: int | None) -> int:
        c = _blocks(n, world_size, f"the {op} input")
        if m is not None and m != c:
            raise InvalidArgumentError(f"out must have {c} elements")
        return c

    return count


def allgather(world_size: int, rank: int, root: int) -> CountOf:
    return _gathered("allgather", world_size)


def reduce_scatter(world_size: int, rank: int, root: int) -> CountOf:
    return _scattered("reduce_scatter", world_size)


def gather(world_size: int, rank: int, root: int) -> CountOf:
    """At the root as allgather; elsewhere one block in, nothing out."""
    return _gathered("gather", world_size) if rank == root else same(world_size, rank, root)


def scatter(world_size: int, rank: int, root: int) -> CountOf:
    """At the root as reduce_scatter; elsewhere one block received."""
    return _scattered("scatter", world_size) if rank == root else same(world_size, rank, root)


def alltoall(world_size: int, rank: int, root: int) -> CountOf:
    def count(n: int, m: int | None) -> int:
        if m != n:
            raise InvalidArgumentError(f"out has {m} elements, x {n}: they must be equal")
        return _blocks(n, world_size, "the alltoall input")

    return count


@dataclass(frozen=True)
class Op:
    doc: str  # the blocking call's docstring
    count: Callable[[int, int, int], CountOf] | None = None  # (world size, rank, root) -> rule
    p2p: bool = False  # waited on the pair job's Future (Client._wait), not Client._blocking
    returns: str = ""  # the blocking call's return annotation; "None": the result is dropped


OPS: dict[str, Op] = {
    "allreduce": Op(
        """Reduce ``x`` over every rank of the job (op: sum, prod, min, max, avg).

        In place unless ``out`` is given (then ``x`` is only read).
        ``algorithm`` forces one (lp, ring, mst, be, direct); None lets the daemon tune.

        >>> g = client.zeros(4); g[:] = client.rank
        >>> client.allreduce(g, op="sum")    # every rank: 0 + 1 + ... + (P-1)
        """,
        same,
    ),
    "broadcast": Op(
        """Copy root's ``x`` to every rank (into ``x``, or ``out`` if given).

        >>> client.broadcast(weights, root=0)
        """,
        same,
    ),
    "reduce": Op(
        """Reduce ``x`` over every rank into root's buffer; other ranks' buffers are untouched.

        >>> client.reduce(loss, root=0, op="avg")
        """,
        same,
    ),
    "allgather": Op(
        """Gather every rank's block into every rank's output.

        Out of place: ``x`` holds this rank's count elements, ``out`` P*count. In place:
        ``x`` is the P*count output with this rank's block at rank*count.

        >>> out = client.empty(client.world_size * 4); client.allgather(block, out=out)
        """,
        allgather,
    ),
    "reduce_scatter": Op(
        """Reduce the P*count input over ranks; rank r gets block r (into ``out``, or in
        place into x[r*count:(r+1)*count]).

        >>> mine = client.empty(n // client.world_size); client.reduce_scatter(x, out=mine)
        """,
        reduce_scatter,
    ),
    "gather": Op(
        """Gather every rank's block ``x`` into the root's output, in rank order.

        At the root: ``out`` of P*count elements, or in place ``x`` is the P*count output
        holding the root's block at root*count. Other ranks pass their count elements;
        their ``out`` is ignored.

        >>> everything = client.empty(client.world_size * 4) if client.rank == 0 else None
        >>> client.gather(mine, root=0, out=everything)
        """,
        gather,
    ),
    "scatter": Op(
        """Send block r of the root's P*count ``x`` to rank r.

        At the root: into ``out`` (count elements), or in place (its block of ``x`` is
        already there). Other ranks receive into ``out`` or, without one, into ``x``.

        >>> mine = client.empty(4); client.scatter(shards if client.rank == 0 else mine, out=mine)
        """,
        scatter,
    ),
    "alltoall": Op(
        """Block j of this rank's ``x`` goes to rank j, and block i of ``out`` comes from
        rank i (P blocks of count elements each; out of place).

        >>> client.alltoall(tokens_by_expert, out=tokens_for_me)
        """,
        alltoall,
    ),
    "barrier": Op("""Block until every rank of the job has reached this barrier.""", returns="None"),
    "send": Op(
        """Send ``x`` to rank ``dst``; returns once ``dst`` received it (its recv with the
        same tag, the same count and dtype). Messages keep their order per (source,
        destination, tag); another tag never waits on this one.

        >>> client.send(activations, dst=client.rank + 1)
        """,
        p2p=True,
        returns="None",
    ),
    "recv": Op(
        """Receive rank ``src``'s message with ``tag`` into ``x`` (as many elements of the
        same dtype as were sent: another size fails on both sides, naming both counts).

        >>> client.recv(activations, src=client.rank - 1)
        """,
        p2p=True,
    ),
    "recv_any": Op(
        """Receive the next message with ``tag`` from whichever rank sends one (torch's
        ``recv(src=None)``) into ``x``; returns the sender's rank. Receives from any source
        match messages in the order they were issued; a receive from a named source issued
        earlier keeps that source's next message. Fails DEADLINE_EXCEEDED when no message
        comes within ``timeout``.

        >>> sender = client.recv_any(result)
        """,
        p2p=True,
        returns="int",
    ),
}
COLLECTIVES = tuple(name for name, op in OPS.items() if not op.p2p)


def blocking(start: Callable[Concatenate[Any, P], Future]) -> Callable[Concatenate[Any, P], Any]:
    """The blocking twin of Client method ``start`` (``<name>_async``), from OPS[name]."""
    name = start.__name__.removesuffix("_async")
    op = OPS[name]
    signature = inspect.signature(start)
    at = list(signature.parameters).index("timeout") - 1  # among the arguments after self
    drop = op.returns == "None"

    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> Any:
        timeout = args[at] if len(args) > at else kwargs.get("timeout")
        begin = getattr(self, start.__name__)  # (an override of the async call counts)
        if op.p2p:
            here = self._here
            here.p2p_now = True  # send/recv: answered on this thread (_p2p.py, ``now``)
            try:
                future = begin(*args, **kwargs)
            finally:
                here.p2p_now = False
            result = self._wait(future, timeout)
        else:
            result = self._blocking(lambda: begin(*args, **kwargs), timeout)
        return None if drop else result

    call.__name__, call.__qualname__ = name, start.__qualname__.removesuffix("_async")
    call.__module__, call.__doc__ = start.__module__, inspect.cleandoc(op.doc)
    empty = inspect.Signature.empty
    call.__signature__ = signature.replace(return_annotation=op.returns or empty)  # type: ignore[attr-defined]
    return call
