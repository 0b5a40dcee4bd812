"""Ports for local listeners (a daemon's peer or metrics port, torchrun's master port),
picked below the kernel's ephemeral range.

A port that bind(0) hands out comes from the ephemeral range, and the next outgoing
connection of any process (UCX opens many) may take it before the listener binds it
again. Ports picked from below that range, and checked bindable on every interface
(UCX listens on 0.0.0.0), only collide with other listeners.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32000  # below /proc/sys/net/ipv4/ip_local_port_range (32768..)
_pick = random.Random()


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now on every interface."""
    ports: list[int] = []
    while len(ports) < n:
        port = _pick.randrange(_LOW, _HIGH)
        if port in ports:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
    return ports
