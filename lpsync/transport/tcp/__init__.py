"""The peer plane over plain TCP sockets: the same Endpoint and mesh as the UCX backend,
with no progress thread between the caller and the kernel."""

from lpsync.transport.tcp.endpoint import TcpEndpoint
from lpsync.transport.tcp.runtime import TcpRuntime

__all__ = ["TcpEndpoint", "TcpRuntime"]
