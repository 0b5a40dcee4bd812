"""Peer discovery: every daemon's peer address in node-rank order, and which one is us.

Three sources, exactly one per daemon (config.py checks that):
  * ``--peers H:P,...``: the list as given; ``--node-rank`` says which entry is us.
  * ``--peers-dns NAME:PORT``: every address NAME resolves to (a Kubernetes headless
    Service), sorted numerically so every daemon derives the same order; this node is the
    entry matching one of its own addresses, unless ``--node-rank`` says otherwise.
  * ``--peers-slurm``: SLURM_JOB_NODELIST expanded in order (``node[01-03,07],gpu5``),
    each host on ``--peer-port``; this node is SLURM_NODEID.
Invariant: every daemon of a cluster computes the same list, so list index = node rank.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lpsync.errors import ConfigError
from lpsync.transport.addresses import PeerAddress, parse_address, parse_peers


@dataclass(frozen=True)
class PeerSet:
    peers: tuple[PeerAddress, ...]  # every daemon, node-rank order, this one included
    node_rank: int  # this daemon's index into peers


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact host list: ``a[1-3,07],b`` -> a1 a2 a3 a07 b (zero padding kept,
    several bracket groups in one name multiply out, order preserved)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            names.extend(_expand_one(item))
    if not names:
        raise ConfigError("SLURM_JOB_NODELIST is empty")
    return names


def _split_top(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {text!r}: unbalanced '['")
    items.append(text[start:])
    return items


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out: list[str] = []
    for part in match.group(1).split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ConfigError(f"node list entry {item!r}: bad range {part!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if dash else lo) + 1):
            out.extend(head + str(n).zfill(width) + rest for rest in _expand_one(tail))
    return out


def is_local_address(host: str) -> bool:
    """True when this machine owns ``host`` (binding a socket to it succeeds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def _resolve_all(name: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"--peers-dns: cannot resolve {name!r}: {error}") from None
    return [str(info[4][0]) for info in infos]


def from_dns(
    target: str,
    node_rank: int | None,
    resolve: Callable[[str, int], Sequence[str]] = _resolve_all,
    is_local: Callable[[str], bool] = is_local_address,
) -> PeerSet:
    where = parse_address(target)
    addresses = sorted(
        {ipaddress.ip_address(a) for a in resolve(where.host, where.port)}, key=lambda a: (a.version, a)
    )
    if not addresses:
        raise ConfigError(f"--peers-dns {target}: the name resolves to no address")
    peers = tuple(PeerAddress(str(a), where.port) for a in addresses)
    if node_rank is None:
        mine = [i for i, p in enumerate(peers) if is_local(p.host)]
        if len(mine) != 1:
            raise ConfigError(
                f"--peers-dns {target}: {len(mine)} of its addresses "
                f"({', '.join(p.host for p in peers)}) are this machine's; give --node-rank"
            )
        node_rank = mine[0]
    return _checked(PeerSet(peers, node_rank), f"--peers-dns {target}")


def from_slurm(environ: Mapping[str, str], port: int, node_rank: int | None) -> PeerSet:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("--peers-slurm: SLURM_JOB_NODELIST is not set (run under srun/sbatch)")
    if node_rank is None:
        nodeid = environ.get("SLURM_NODEID", "")
        if not nodeid.isdigit():
            raise ConfigError("--peers-slurm: SLURM_NODEID is not set; give --node-rank")
        node_rank = int(nodeid)
    peers = tuple(PeerAddress(host, port) for host in expand_nodelist(nodelist))
    return _checked(PeerSet(peers, node_rank), "--peers-slurm")


def from_list(text: str, node_rank: int | None) -> PeerSet:
    if node_rank is None:
        raise ConfigError("--peers needs --node-rank: which entry of the list is this daemon")
    return _checked(PeerSet(tuple(parse_peers(text)), node_rank), "--peers")


def _checked(found: PeerSet, source: str) -> PeerSet:
    if not 0 <= found.node_rank < len(found.peers):
        raise ConfigError(
            f"{source}: node rank {found.node_rank} is not an index into {len(found.peers)} peers"
        )
    return found


def discover(
    peers: str, peers_dns: str, peers_slurm: bool, node_rank: int, peer_port: int, environ: Mapping[str, str]
) -> PeerSet | None:
    """The peer set from the daemon's settings; None for a single-node daemon.
    ``node_rank`` < 0 means "not given"."""
    given = [
        name
        for name, on in (
            ("--peers", bool(peers)),
            ("--peers-dns", bool(peers_dns)),
            ("--peers-slurm", peers_slurm),
        )
        if on
    ]
    if len(given) > 1:
        raise ConfigError(f"give one peer source, not {' and '.join(given)}")
    rank = node_rank if node_rank >= 0 else None
    if peers:
        return from_list(peers, rank)
    if peers_dns:
        return from_dns(peers_dns, rank)
    if peers_slurm:
        return from_slurm(environ, peer_port, rank)
    return None
