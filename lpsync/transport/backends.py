"""Choosing the peer plane's transport: ``ucx`` (the default) or ``tcp`` (plain sockets).

Both give the same Endpoint (lpsync.engine.endpoint) over the same mesh and failure
model (lpsync.transport.mesh); a runtime (listener, and UCX's worker) outlives the
meshes built on it. Callers pick one by name and never import a backend themselves.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Protocol

from lpsync.errors import ConfigError
from lpsync.transport.mesh import MeshEndpoint, MeshOptions

TRANSPORTS = ("ucx", "tcp")


class Runtime(Protocol):
    @property
    def alive(self) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...


def check(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown peer transport {transport!r}; one of {', '.join(TRANSPORTS)}")
    return transport


def open_runtime(transport: str, port: int, tls: str | None = None) -> Runtime:
    """Listen on ``port`` for ``transport``'s meshes; ``tls`` is UCX_TLS (ucx only)."""
    if check(transport) == "tcp":
        from lpsync.transport.tcp import TcpRuntime

        return TcpRuntime(port)
    from lpsync.transport.ucx import RuntimeOptions, UcxRuntime

    return UcxRuntime(RuntimeOptions(port, tls))


def connect(
    transport: str, options: MeshOptions, runtime: Runtime | None = None, tls: str | None = None
) -> MeshEndpoint:
    """Form the mesh on ``runtime`` (or on one of its own, closed with it)."""
    if check(transport) == "tcp":
        from lpsync.transport.tcp import TcpEndpoint, TcpRuntime

        assert runtime is None or isinstance(runtime, TcpRuntime)
        return TcpEndpoint.connect(options, runtime)
    from lpsync.transport.ucx import UcxEndpoint, UcxOptions, UcxRuntime

    assert runtime is None or isinstance(runtime, UcxRuntime)
    base = {f.name: getattr(options, f.name) for f in fields(MeshOptions)}
    return UcxEndpoint.connect(UcxOptions(**base, tls=tls), runtime)
