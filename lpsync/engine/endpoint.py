"""The transport interface the executor talks to; algorithms never see the wire.

One Endpoint per participant. Sends are asynchronous and return a request that
completes when the sent span may be written again; receives block up to a
deadline. Messages are matched by (peer, tag). Backends live in lpsync.transport.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from lpsync.transport.mesh import Channel


class SendRequest(Protocol):
    def done(self) -> bool:
        """True once the sent span may be overwritten."""

    def wait(self, deadline: float) -> None:
        """Block until done, or raise CollectiveTimeoutError at ``deadline`` (time.monotonic)."""


class Endpoint(Protocol):
    rank: int
    size: int

    def send(self, peer: int, tag: int, data: np.ndarray) -> SendRequest:
        """Start sending the contiguous array ``data``; it must not change until done()."""

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        """Receive the message (peer, tag) into ``out`` (same number of bytes)."""

    def recv_borrow(
        self, peer: int, tag: int, nbytes: int, deadline: float
    ) -> AbstractContextManager[np.ndarray]:
        """Receive (peer, tag) and lend its bytes (a read-only uint8 array) for the
        duration of the with-block; zero-copy where the transport allows."""


class RecvRequest(Protocol):
    def wait(self, deadline: float) -> None:
        """Block until the message has landed, or raise (CollectiveTimeoutError at ``deadline``)."""


class PostingEndpoint(Endpoint, Protocol):
    """An Endpoint that can also post receives ahead (a network transport: the message
    then flows while the participant works on earlier steps, instead of waiting for the
    receive). A Plan that posted receives and fails aborts the endpoint, so nothing lands
    in its buffers afterwards."""

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> RecvRequest | None:
        """Start receiving (peer, tag) into ``out``; None when this peer's messages are
        better received in turn (e.g. a local peer behind a routed endpoint)."""

    def abort(self, error: BaseException) -> None:
        """Break the endpoint: in-flight requests are cancelled, every wait raises."""


class ChannelEndpoint(PostingEndpoint, Protocol):
    """A PostingEndpoint with a Channel per peer (lpsync.transport.mesh.Channel: the TCP
    backend's), so that a program runs as data flow (lpsync.engine.dataflow)."""

    def channel(self, peer: int) -> Channel | None:
        """``peer``'s Channel, or None where this endpoint has none for it."""
