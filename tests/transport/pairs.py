"""Two endpoints of one backend connected in this process, for the backends' own tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from lpsync.transport.addresses import PeerAddress
from lpsync.transport.mesh import MeshOptions
from tests.ports import free_ports


def threads(prefix: str) -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix)}


@contextmanager
def connected_pair(
    connect: Callable[[MeshOptions], Any], secret: bytes, prefix: str
) -> Iterator[tuple[Any, Any]]:
    """Ranks 0 and 1 on loopback, connected at once (``connect`` one rank's options);
    closed together afterwards, and then no thread named ``prefix``... is left."""
    peers = tuple(PeerAddress("127.0.0.1", port) for port in free_ports(2))
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(connect, MeshOptions(r, peers, secret, connect_timeout=20.0)) for r in range(2)
        ]
        a, b = (f.result() for f in futures)
    try:
        yield a, b
    finally:
        with ThreadPoolExecutor(2) as pool:  # close is collective: both at once
            list(pool.map(lambda e: e.close(), (a, b)))
    assert threads(prefix) == set()


def next_message_intact(a: Any, b: Any, deadline: float) -> None:
    """After a refused message (rank 0 ``a`` sent it to rank 1 ``b``): the connection goes
    on, neither endpoint broken."""
    a.send(1, 3, np.full(5, 9, np.uint8)).wait(deadline)
    nine = np.zeros(5, np.uint8)
    b.recv_into(0, 3, nine, deadline)
    assert (nine == 9).all() and a.error is None and b.error is None
