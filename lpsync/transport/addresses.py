"""Peer addresses as the CLI gives them: ``host:port,host:port,...`` in node-rank order."""

from __future__ import annotations

from dataclasses import dataclass

from lpsync.errors import ConfigError


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> PeerAddress:
    """``host:port``, ``[v6]:port``; ConfigError for anything else."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"peer address {text!r} is not HOST:PORT (port 1..65535)")
    return PeerAddress(host, int(port))


def parse_peers(text: str) -> list[PeerAddress]:
    """Every node's peer address in node-rank order; duplicates are refused."""
    peers = [parse_address(item) for item in text.split(",") if item.strip()]
    if not peers:
        raise ConfigError("--peers is empty; list every node's HOST:PORT in node-rank order")
    seen: set[PeerAddress] = set()
    for rank, peer in enumerate(peers):
        if peer in seen:
            raise ConfigError(f"peer address {peer} appears twice (again as rank {rank})")
        seen.add(peer)
    return peers
