"""Choosing the peer plane's transport: ``ucx`` or ``tcp`` (plain sockets), or ``auto``.

``auto`` (the daemon's default) takes UCX where the node has an RDMA device, which is
what UCX brings over plain sockets, and the TCP backend elsewhere: on Ethernet, UCX over
TCP measured slower and costlier per message than plain sockets (docs/benchmarks.md).
Both give the same Endpoint (lpsync.engine.endpoint) over the same mesh and failure
model (lpsync.transport.mesh); a runtime (listener, and UCX's worker) outlives the
meshes built on it. Callers pick one by name and never import a backend themselves.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lpsync.errors import ConfigError
from lpsync.transport.mesh import MeshEndpoint, MeshOptions

if TYPE_CHECKING:
    from lpsync.transport.ucx.device_support import DevicePath

TRANSPORTS = ("ucx", "tcp")
AUTO = "auto"
# The daemon's peer_device_path (lpsync.transport.ucx.device_support.choose).
DEVICE_PATH_CHOICES = (AUTO, "staged", "device")
CHOICES = (AUTO, *TRANSPORTS)  # what --peer-transport accepts
# Where the kernel lists RDMA devices (InfiniBand, RoCE, iWARP): UCX's verbs transports
# find them there too.
RDMA_CLASS = Path("/sys/class/infiniband")


class Runtime(Protocol):
    @property
    def alive(self) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...


def check(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown peer transport {transport!r}; one of {', '.join(TRANSPORTS)}")
    return transport


def rdma_devices(where: Path = RDMA_CLASS) -> list[str]:
    """The node's RDMA devices by name (mlx5_0, ...); empty without any."""
    try:
        return sorted(entry.name for entry in where.iterdir())
    except OSError:  # no such class: no RDMA stack loaded
        return []


@dataclass(frozen=True)
class Rdma:
    """The node's RDMA devices, listed once at the daemon's start for every choice that
    depends on them (the transport, UCX_TLS, the BBR warning)."""

    devices: tuple[str, ...]
    where: Path = RDMA_CLASS

    @classmethod
    def scan(cls, where: Path = RDMA_CLASS) -> Rdma:
        return cls(tuple(rdma_devices(where)), where)

    def named(self) -> str:
        return f"RDMA device(s) {', '.join(self.devices)} under {self.where}"


def resolve(transport: str, rdma: Rdma) -> tuple[str, str]:
    """(the transport to run, why): ``auto`` becomes ucx with an RDMA device, else tcp."""
    if transport != AUTO:
        return check(transport), "asked for (--peer-transport)"
    if rdma.devices:
        return "ucx", f"auto: {rdma.named()}"
    return "tcp", f"auto: no RDMA device under {rdma.where} (plain sockets cost less per message on Ethernet)"


def resolve_tls(ucx_tls: str, rdma: Rdma) -> tuple[str, str]:
    """(UCX_TLS for the UCX peer transport, why): ``auto`` lets UCX choose where the node
    has an RDMA device (its verbs transports are what UCX is for; forced onto TCP it
    brings nothing), else keeps it on TCP (co-located daemons, as on the emulated cluster,
    would otherwise meet over shared memory and bypass the network). Anything else is
    UCX_TLS as given ("": the environment's UCX_TLS, else UCX's choice)."""
    if ucx_tls != AUTO:
        return ucx_tls, "asked for (--ucx-tls)"
    if rdma.devices:
        return "", f"auto: {rdma.named()}: UCX chooses"
    return "tcp", f"auto: no RDMA device under {rdma.where}: TCP"


def device_path(transport: str, memory: str, ucx_tls: str, wanted: str = "auto") -> DevicePath:
    """How device chunks cross the peer plane of ``transport``: UCX sends device memory
    itself, or they are staged through host memory (lpsync.transport.ucx.device_support;
    may run ``ucx_info -d``, bounded). ``memory``: the kind the daemon serves (cpu, cuda,
    emulated); ``ucx_tls``: the daemon's setting ("" defers to the environment's);
    ``wanted``: its peer_device_path setting (auto, staged, device)."""
    from lpsync.transport.ucx import device_support

    tls = device_support.effective_tls(ucx_tls)
    return device_support.choose(wanted, check(transport), memory, tls)


def open_runtime(transport: str, port: int, tls: str | None = None, until_exit: bool = False) -> Runtime:
    """Listen on ``port`` for ``transport``'s meshes; ``tls`` is UCX_TLS (ucx only).
    ``until_exit``: the runtime lives as long as the process, which then must end with
    os._exit once ``exit_needs_os_exit()`` (UCX keeps its objects until then)."""
    if check(transport) == "tcp":
        from lpsync.transport.tcp import TcpRuntime

        return TcpRuntime(port)
    from lpsync.transport.ucx import RuntimeOptions, UcxRuntime

    return UcxRuntime(RuntimeOptions(port, tls, until_exit=until_exit))


def exit_needs_os_exit() -> bool:
    """True when a runtime opened ``until_exit`` kept UCX objects that the interpreter's
    finalization must not destroy."""
    progress = sys.modules.get("lpsync.transport.ucx.progress")
    return progress is not None and progress.kept_until_exit()


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
