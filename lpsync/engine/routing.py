"""Routing one collective's messages between the participants of several nodes.

A multi-node collective is one schedule over every participant of the job. Numbered
node-major (node 0's local ranks first, then node 1's, ...), an LP or ring chain crosses
each node boundary once and its local and inter-node stages form one chunk pipeline;
any other map of ranks to nodes runs too, crossing more often. On each node the daemon
runs the plans of its own participants; a message between two of them goes through the
node's inproc fabric, a message to another node through the node-level transport (one
Endpoint per daemon, peers = node indices) with sender, receiver and tag folded into the
transport's tag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from lpsync.engine.endpoint import Endpoint, RecvRequest, SendRequest
from lpsync.errors import InvalidArgumentError
from lpsync.transport.mesh import Channel
from lpsync.transport.tags import FOLD_SHIFT, MAX_PARTICIPANTS, MESSAGE_BITS, fold

_MAX_TAG = 1 << MESSAGE_BITS  # a message tag above the folded ranks (lpsync.transport.tags)


@dataclass(frozen=True)
class Placement:
    """The node of every participant, and which node this is."""

    node_of: tuple[int, ...]
    node: int

    @classmethod
    def of(cls, node_of: Sequence[int], node: int) -> Placement:
        """Any map of participants to nodes 0..N-1 (a job's ranks need not be node-major;
        the chain then crosses node boundaries more often, and stays correct)."""
        if len(node_of) > MAX_PARTICIPANTS:
            raise InvalidArgumentError(f"at most {MAX_PARTICIPANTS} participants per job")
        nodes = max(node_of, default=-1) + 1
        if min(node_of, default=0) < 0 or len(set(node_of)) != nodes:
            raise InvalidArgumentError("every node needs at least one participant")
        if not 0 <= node < nodes:
            raise InvalidArgumentError(f"node {node} is not one of {nodes}")
        return cls(tuple(node_of), node)

    @classmethod
    def node_major(cls, ranks_per_node: Sequence[int], node: int) -> Placement:
        if any(n < 1 for n in ranks_per_node):
            raise InvalidArgumentError("every node needs at least one participant")
        return cls.of([i for i, n in enumerate(ranks_per_node) for _ in range(n)], node)

    @property
    def local_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == self.node]


class RoutedEndpoint:
    """The Endpoint of participant ``rank``: local peers via ``local``, others via ``remote``."""

    def __init__(self, rank: int, placement: Placement, local: Endpoint, remote: Endpoint) -> None:
        self.rank, self.size = rank, len(placement.node_of)
        self._node_of, self._node = placement.node_of, placement.node
        self._local, self._remote = local, remote
        self._post_remote = getattr(remote, "post_recv", None)  # a PostingEndpoint's, if any
        # Per peer, worked out once (every chunk of a pipeline asks): its node, or -1 for
        # a local peer, and its sender and receiver bits of a folded tag (fold()).
        self._route = [-1 if n == self._node else n for n in self._node_of]
        self._to_bits = [fold(rank, peer, 0) for peer in range(self.size)]
        self._from_bits = [fold(peer, rank, 0) for peer in range(self.size)]

    def _is_local(self, peer: int) -> bool:
        return self._node_of[peer] == self._node

    def send(self, peer: int, tag: int, data: np.ndarray) -> SendRequest:
        node = self._route[peer]
        if node < 0:
            return self._local.send(peer, tag, data)
        if tag >= _MAX_TAG:
            fold(self.rank, peer, tag)  # raises, naming the tag
        return self._remote.send(node, (tag << FOLD_SHIFT) | self._to_bits[peer], data)

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        if self._is_local(peer):
            self._local.recv_into(peer, tag, out, deadline)
        else:
            self._remote.recv_into(self._node_of[peer], fold(peer, self.rank, tag), out, deadline)

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> RecvRequest | None:
        """A message from another node is posted ahead when the node-level transport can;
        a local one is taken in turn (the inproc fabric hands it over without a copy)."""
        post, node = self._post_remote, self._route[peer]
        if post is None or node < 0:
            return None
        if tag >= _MAX_TAG:
            fold(peer, self.rank, tag)  # raises, naming the tag
        return post(node, (tag << FOLD_SHIFT) | self._from_bits[peer], out)  # type: ignore[no-any-return]

    def channel(self, peer: int) -> Channel | None:
        """A peer on another node: the node-level transport's Channel to its node, with
        this pair's folded tags (lpsync.transport.mesh.Channel); None for a local peer
        or a transport without channels."""
        node, channel = self._route[peer], getattr(self._remote, "channel", None)
        if node < 0 or channel is None:
            return None
        remote = channel(node)
        if remote is None:
            return None
        return dataclasses.replace(
            remote, shift=FOLD_SHIFT, send_bits=self._to_bits[peer], recv_bits=self._from_bits[peer]
        )

    def abort(self, error: BaseException) -> None:
        abort = getattr(self._remote, "abort", None)
        if abort is not None:
            abort(error)

    def recv_borrow(
        self, peer: int, tag: int, nbytes: int, deadline: float
    ) -> AbstractContextManager[np.ndarray]:
        if self._is_local(peer):
            return self._local.recv_borrow(peer, tag, nbytes, deadline)
        return self._remote.recv_borrow(self._node_of[peer], fold(peer, self.rank, tag), nbytes, deadline)
