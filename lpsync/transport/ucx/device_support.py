"""Whether the peer plane hands device chunks to UCX as they are, decided once at start.

Three outcomes (``DevicePath.path``):

* ``device``: UCX itself reports a CUDA-capable transport (``cuda_copy``, ``cuda_ipc``)
  and UCX_TLS lets it use one: UCX can send and receive device memory directly, copying
  through its own host buffers where the network cannot reach the GPU, or straight from
  the GPU with GPUDirect RDMA (an rc/dc/ud transport whose InfiniBand memory domain
  registers cuda memory, with nvidia-peermem loaded; named in the reason, it changes
  nothing in the choice);
* ``staged``: device chunks go through host memory (the daemon's pinned staging,
  docs/gpu.md): the tcp backend, emulated devices, UCX_TLS without cuda transports, or
  UCX reports none (built without CUDA, no driver) or could not be asked;
* ``host``: the daemon serves no devices; the peer plane carries host memory only.

``auto`` (the default) runs ``staged`` wherever ``decide`` would pick ``device`` until the
direct path has passed scripts/gpu_check.sh on a GPU (``DIRECT_PATH_VALIDATED``): it has
never run on one, and ``lpsync status`` says so in the path's reason.

The daemon's ``peer_device_path`` setting may ask for either instead of ``auto``:
``staged`` always (e.g. to rule out a CUDA-aware UCX that misbehaves), ``device`` only
where ``auto`` would choose it, and on emulated devices, whose memory is host memory any
transport carries (how the direct path is tested without a GPU); elsewhere asking for
``device`` is refused with ``auto``'s reason.

UCX's capabilities are what ``ucx_info -d`` prints (the libucx wheel ships the binary):
its memory domains with their memory types and the transports on each. It runs only when
the answer depends on it (a cuda daemon on the ucx backend whose UCX_TLS allows a cuda
transport), bounded in time; any failure reads as "no CUDA support". Pure apart from
``probe`` and ``peermem_module``, which the decision takes as arguments.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE, STAGED, HOST = "device", "staged", "host"
AUTO = "auto"  # the daemon's peer_device_path setting: AUTO, STAGED or DEVICE
CUDA_TRANSPORTS = ("cuda_copy", "cuda_ipc")
# InfiniBand transports that move registered memory with RDMA: with cuda among their
# memory domain's memory types (and nvidia-peermem loaded), GPUDirect RDMA.
_RDMA_PREFIXES = ("rc_", "dc_", "ud_")
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
SYS_MODULE = Path("/sys/module")
# Set once the direct path passed scripts/gpu_check.sh on a GPU (docs/gpu.md); until
# then ``auto`` stages what it would send directly.
DIRECT_PATH_VALIDATED = False
PROBE_TIMEOUT = 10.0  # ucx_info -d opens every device; a node with many HCAs takes seconds

# UCX_TLS aliases as UCX expands them (ucp_context.c, ucp_tl_aliases); ":aux" members
# only carry wireup, never data, so they are left out.
_ALIASES = {
    "mm": ("posix", "sysv", "xpmem"),
    "sm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "shm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "ib": ("rc_verbs", "ud_verbs", "rc_mlx5", "ud_mlx5", "dc_mlx5"),
    "ud_v": ("ud_verbs",),
    "ud_x": ("ud_mlx5",),
    "ud": ("ud_mlx5", "ud_verbs"),
    "rc_v": ("rc_verbs",),
    "rc_x": ("rc_mlx5",),
    "rc": ("rc_mlx5", "rc_verbs"),
    "dc": ("dc_mlx5",),
    "dc_x": ("dc_mlx5",),
    "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"),
}


def _nothing() -> None:
    return None


def claim(buffer: Any) -> Callable[[], None]:
    """On the progress thread, before UCX is handed ``buffer``: a device buffer's device
    made current in this thread (UCX's cuda transports work in the caller's context; with
    none, cuEventQuery in ucp_worker_arm segfaults, nixl#2102) and, on emulated devices,
    the transfer counted on its memory (a free before it ended is a fault). Returns what
    to call once UCX let go of it."""
    bind = getattr(buffer, "lpsync_bind", None)
    if bind is not None:  # an emulated device's bytes (lpsync.memory.emulated.WireView)
        bind()
        end: Callable[[], None] = buffer.lpsync_post()
        return end
    if hasattr(buffer, "__cuda_array_interface__"):  # a cuda kind's wire (cupy)
        from cupy.cuda import runtime

        device = int(buffer.device.id)
        if runtime.getDevice() != device:
            runtime.setDevice(device)  # and its primary context current (CUDA >= 12)
    return _nothing


@dataclass(frozen=True)
class UcxTransport:
    """One transport on one device, as ``ucx_info -d`` lists it."""

    name: str  # tcp, cuda_copy, rc_mlx5, ...
    device: str  # eth0, cuda, mlx5_0:1, ...
    memory_domain: str = ""  # mlx5_0, cuda_cpy, ...
    component: str = ""  # ib, cuda_cpy, tcp, ...
    memory_types: tuple[str, ...] = ()  # of its memory domain: host, cuda, cuda-managed, ...


@dataclass(frozen=True)
class UcxCapabilities:
    transports: tuple[UcxTransport, ...] = ()
    error: str = ""  # why they could not be read; "" when they were

    def names(self) -> set[str]:
        return {t.name for t in self.transports}


@dataclass(frozen=True)
class DevicePath:
    path: str  # DEVICE, STAGED or HOST
    reason: str  # one line, for the log and `lpsync status`
    transports: tuple[str, ...] = ()  # UCX's transports that justify DEVICE
    gpudirect_rdma: bool = False  # informational: see the module's docstring


_FIELD = re.compile(r"^#?\s*([A-Za-z][A-Za-z ]*?)\s*:\s*(.*?)\s*$")
_MEMORY_TYPE = re.compile(r"([a-z][a-z0-9_-]*)\s*(?:\([^)]*\))?")


def parse_ucx_info(text: str) -> UcxCapabilities:
    """The transports of ``ucx_info -d``'s output; unreadable output gives none, and an
    error saying so. Lines it does not know are skipped (the format varies by version)."""
    transports: list[UcxTransport] = []
    md = component = name = ""
    memory_types: tuple[str, ...] = ()
    for line in text.splitlines():
        m = _FIELD.match(line)
        if m is None:
            continue
        key, value = m[1].lower(), m[2]
        if key == "memory domain":
            md, component, name, memory_types = value, "", "", ()
        elif key == "connection manager":
            md, component, name, memory_types = "", "", "", ()  # no transports of its own
        elif key == "component":
            component = value
        elif key == "memory types":
            memory_types = tuple(_MEMORY_TYPE.findall(value))
        elif key == "transport":
            name = value
        elif key == "device" and name and value:
            transports.append(UcxTransport(name, value, md, component, memory_types))
    if not transports:
        return UcxCapabilities(error="ucx_info -d listed no transports")
    return UcxCapabilities(tuple(transports))


def ucx_info_binary() -> tuple[str, dict[str, str]] | None:
    """The ``ucx_info`` of the UCX that ucxx loads (the libucx wheel's, which needs its
    lib/ on LD_LIBRARY_PATH), else one on PATH; with the environment to run it in."""
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    spec = importlib.util.find_spec("libucx")  # finds, does not import (no UCX loaded)
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent
        binary = root / "bin" / "ucx_info"
        if binary.is_file():
            paths = [str(root / "lib"), env.get("LD_LIBRARY_PATH", "")]
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
            return str(binary), env
    found = shutil.which("ucx_info")
    return (found, env) if found else None


def probe(timeout: float = PROBE_TIMEOUT) -> UcxCapabilities:
    """What UCX reports on this node (``ucx_info -d``); on any failure, no transports
    and the error."""
    located = ucx_info_binary()
    if located is None:
        return UcxCapabilities(error="no ucx_info binary (no libucx wheel, none on PATH)")
    binary, env = located
    try:
        done = subprocess.run(
            [binary, "-d"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return UcxCapabilities(error=f"ucx_info -d did not answer within {timeout:g} s")
    except OSError as error:
        return UcxCapabilities(error=f"cannot run {binary}: {error}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][:200]
        return UcxCapabilities(error=f"ucx_info -d exited with {done.returncode}: {last}")
    return parse_ucx_info(done.stdout)


def peermem_module(root: Path = SYS_MODULE) -> str:
    """The loaded kernel module that lets an HCA reach GPU memory; "" when none is."""
    return next((m for m in PEERMEM_MODULES if (root / m).is_dir()), "")


def effective_tls(configured: str, environ: Mapping[str, str] | None = None) -> str:
    """UCX_TLS as the peer plane's UCX sees it: the daemon's ``ucx_tls``, else (empty) the
    environment's UCX_TLS; "" means UCX's default, every transport."""
    return configured or (os.environ if environ is None else environ).get("UCX_TLS", "")


def tls_allows(tls: str, transport: str) -> bool:
    """Whether UCX_TLS ``tls`` lets UCX use ``transport`` (aliases, ``^`` exclusion, ``all``)."""
    items = [item.strip() for item in tls.split(",") if item.strip()]
    if not items:
        return True  # unset: UCX's default is all
    exclude = items[0].startswith("^")
    if exclude:
        items[0] = items[0][1:]
    named: set[str] = set()
    for item in items:
        if item.endswith(":aux"):
            continue
        base = item.split(":", 1)[0]
        if base == "all":
            return not exclude
        named.update(_ALIASES.get(base, (base,)))
    return (transport in named) != exclude


def _tls_text(tls: str) -> str:
    return f"UCX_TLS={tls}" if tls else "UCX_TLS unset (all transports)"


def _gpudirect(capabilities: UcxCapabilities, tls: str) -> tuple[str, ...]:
    """The allowed RDMA transports whose memory domain registers cuda memory."""
    return tuple(
        sorted(
            {
                t.name
                for t in capabilities.transports
                if t.name.startswith(_RDMA_PREFIXES) and "cuda" in t.memory_types and tls_allows(tls, t.name)
            }
        )
    )


def _staged(why: str) -> DevicePath:
    return DevicePath(STAGED, f"{why}: device chunks are staged through host memory")


def choose(
    wanted: str,
    peer_transport: str,
    memory: str,
    ucx_tls: str,
    capabilities: Callable[[], UcxCapabilities] = probe,
    peermem: Callable[[], str] = peermem_module,
) -> DevicePath:
    """The device path the daemon runs: ``decide``'s, or what ``wanted`` (AUTO, STAGED,
    DEVICE) asks for where that is possible; InvalidArgumentError naming why where not."""
    from lpsync.errors import InvalidArgumentError

    if wanted == STAGED:
        if memory not in ("cuda", "emulated"):
            return decide(peer_transport, memory, ucx_tls, capabilities, peermem)
        return _staged("asked for (--peer-device-path staged)")
    found = decide(peer_transport, memory, ucx_tls, capabilities, peermem)
    if wanted == AUTO and found.path == DEVICE and not DIRECT_PATH_VALIDATED:
        return _staged(
            f"auto stages until the direct path has passed scripts/gpu_check.sh on a GPU "
            f"(--peer-device-path device asks for it; {found.reason})"
        )
    if wanted == AUTO or found.path == DEVICE:
        return found
    if memory == "emulated":
        return DevicePath(
            DEVICE,
            "asked for (--peer-device-path device): emulated device memory is host memory, "
            "which every transport carries as it is",
        )
    raise InvalidArgumentError(f"--peer-device-path device is not possible here: {found.reason}")


def decide(
    peer_transport: str,
    memory: str,
    ucx_tls: str,
    capabilities: Callable[[], UcxCapabilities] = probe,
    peermem: Callable[[], str] = peermem_module,
) -> DevicePath:
    """The peer plane's device path. ``peer_transport``: "ucx" or "tcp" (after ``auto``
    was resolved); ``memory``: the kind the daemon serves ("cuda", "emulated", "cpu" or
    "" for none); ``ucx_tls``: UCX_TLS as UCX sees it (``effective_tls``). The
    capabilities are asked for only when the answer depends on them."""
    if peer_transport not in ("ucx", "tcp"):
        raise ValueError(f"peer transport {peer_transport!r}: expected ucx or tcp")
    if memory not in ("cuda", "emulated"):
        return DevicePath(HOST, "the daemon serves no devices: the peer plane carries host memory only")
    if memory == "emulated":
        return _staged("emulated devices are host memory UCX cannot address as a device")
    if peer_transport == "tcp":
        return _staged("the tcp peer transport sends host memory only")
    if not any(tls_allows(ucx_tls, t) for t in CUDA_TRANSPORTS):
        return _staged(f"{_tls_text(ucx_tls)} excludes UCX's cuda transports (cuda_copy, cuda_ipc)")
    found = capabilities()
    if found.error:
        return _staged(f"UCX's capabilities could not be read ({found.error})")
    names = found.names()
    usable = tuple(t for t in CUDA_TRANSPORTS if t in names and tls_allows(ucx_tls, t))
    if not usable:
        return _staged("UCX reports no cuda_copy or cuda_ipc transport on this node (no CUDA driver?)")
    rdma = _gpudirect(found, ucx_tls)
    module = peermem() if rdma else ""
    allowed = _tls_text(ucx_tls)
    reason = f"UCX reports {', '.join(usable)}, allowed by {allowed}: UCX can send device memory itself"
    if rdma and module:
        reason += f"; GPUDirect RDMA: {', '.join(rdma)} registers cuda memory and {module} is loaded"
        return DevicePath(DEVICE, reason, usable + rdma, gpudirect_rdma=True)
    if rdma:
        reason += (
            f"; no GPUDirect RDMA: {', '.join(rdma)} registers cuda memory but neither "
            f"{' nor '.join(PEERMEM_MODULES)} is loaded (UCX copies through host memory itself)"
        )
    else:
        reason += " (no GPUDirect RDMA transport: UCX copies through host memory itself across nodes)"
    return DevicePath(DEVICE, reason, usable)
