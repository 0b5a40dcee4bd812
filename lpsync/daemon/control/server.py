"""Wiring: the grpc.aio server with LpSync, health and reflection; listeners; shutdown.

Shutdown (SIGTERM/SIGINT): health goes NOT_SERVING, new work is refused, running
collectives drain (config.drain_seconds), every session ends (its waiting collectives
are aborted, its shared memory unlinked), the server stops and the sockets are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import hmac
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from lpsync.daemon.control import decoding
from lpsync.daemon.control.config import DaemonConfig
from lpsync.daemon.control.handlers import Service
from lpsync.daemon.control.metrics import Metrics
from lpsync.daemon.control.state import DaemonState
from lpsync.daemon.control.trigger import TriggerServer
from lpsync.daemon.peers.plane import PeerPlane, PeerPlaneOptions
from lpsync.errors import InvalidArgumentError
from lpsync.memory import reclaim_stale
from lpsync.memory.devices import parse_devices
from lpsync.transport import backends
from lpsync.transport.auth import load_secret
from lpsync.transport.tcp import congestion as tcp_congestion
from lpsync.transport.ucx import device_support
from lpsync.types import dtype_of
from lpsync_client.wire.proto import lpsync_pb2 as pb

log = logging.getLogger("lpsync.daemon")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LpSync"].full_name
_DENIED = "missing or wrong token: send 'authorization: Bearer <token>'"


async def _deny_unary(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield  # makes this an async generator, as streaming handlers are


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>`` (compared in constant time),
    except health checks, which probes make without credentials and which reveal nothing."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny_unary)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny_stream)
        return grpc.unary_unary_rpc_method_handler(_deny_unary)


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.plane, peer_info = _peer_plane(config, self.metrics)
        self.state = DaemonState(config, self.metrics, self.plane)
        self.state.peer_plane = peer_info
        if self.state.devices is not None:
            self.state.devices.peer_direct = peer_info.device_path == device_support.DEVICE
        self.service = Service(self.state)
        self.health = health.aio.HealthServicer()
        token = config.token()
        if config.token_file and not token:
            raise InvalidArgumentError(f"token file {config.token_file} is empty")
        self._interceptors = [TokenInterceptor(token)] if token else []
        self.socket = Path(config.socket) if config.socket else None
        self.trigger = (
            TriggerServer(Path(f"{self.socket}.trigger"), self.service)
            if self.socket is not None and config.trigger
            else None
        )
        self.state.trigger_path = str(self.trigger.path) if self.trigger else ""
        self.server: grpc.aio.Server | None = None
        self._stop: asyncio.Event | None = None
        self.wedged = False  # a transport thread did not stop (see serve)

    async def start(self) -> None:
        self.service.bind_loop(asyncio.get_running_loop())
        self._stop = asyncio.Event()
        self.server = grpc.aio.server(
            interceptors=self._interceptors, options=[("grpc.max_receive_message_length", 16 << 20)]
        )
        # Requests are decoded inside the handlers: undecodable bytes are INVALID_ARGUMENT.
        decoding.add_service(self.server, self.service, pb.DESCRIPTOR.services_by_name["LpSync"])
        decoding.add_service(self.server, self.health, health_pb2.DESCRIPTOR.services_by_name["Health"])
        decoding.add_service(
            self.server,
            reflection.aio.ReflectionServicer(
                (
                    SERVICE_NAME,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                )
            ),
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
        )
        reclaimed = reclaim_stale()
        if reclaimed:
            log.warning("unlinked shared memory of daemons that died", extra={"segments": reclaimed})
        if self.socket is not None:
            self.socket.parent.mkdir(parents=True, exist_ok=True)
            if self.socket.exists():
                if _socket_alive(self.socket):
                    raise InvalidArgumentError(
                        f"another daemon is listening on {self.socket}; stop it or use --socket"
                    )
                self.socket.unlink()  # stale, from a daemon that was killed
            # umask first: the socket must never be wider than 0660, not even briefly
            old = os.umask(0o117)
            try:
                self.server.add_insecure_port(f"unix:{self.socket}")
            finally:
                os.umask(old)
        if self.config.listen:
            credentials = grpc.ssl_server_credentials(
                [(Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes())]
            )
            self.server.add_secure_port(self.config.listen, credentials)
        await self.server.start()
        if self.socket is not None:
            os.chmod(self.socket, 0o660)
        if self.trigger is not None:
            self.trigger.start()
        # bfloat16's dtype before serving, so that the first bfloat16 collective does not
        # import ml_dtypes (~0.5 s) on the event loop (the CLI never needs it).
        dtype_of("bfloat16")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        if self.plane is not None:
            self.plane.start()  # connects in the background; local jobs are served meanwhile
        # What start-up made (modules, the gRPC server, protobuf descriptors: ~45 000
        # objects) lives as long as the daemon: out of the cyclic collector's sight, a full
        # collection scans only what came since (23 ms -> a few, docs/daemon.md).
        gc.freeze()
        log.info(
            "daemon serving",
            extra={
                "socket": str(self.socket or ""),
                "listen": self.config.listen,
                "metrics_port": self.config.metrics_port,
                "pid": os.getpid(),
                "frozen_objects": gc.get_freeze_count(),
            },
        )

    def request_stop(self) -> None:
        assert self._stop is not None
        self._stop.set()

    async def wait(self) -> None:
        assert self._stop is not None
        await self._stop.wait()

    async def stop(self) -> None:
        log.info("shutting down: draining collectives")
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        # Draining blocks on running collectives; the loop keeps serving replies meanwhile.
        await loop.run_in_executor(None, self.state.shutdown, self.config.drain_seconds)
        if self.trigger is not None:
            await loop.run_in_executor(None, self.trigger.stop)
        if self.plane is not None:
            self.wedged = not await loop.run_in_executor(None, self.plane.stop)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket.unlink()
        log.info("daemon stopped")


def _peer_plane(config: DaemonConfig, metrics: Metrics) -> tuple[PeerPlane | None, pb.PeerPlaneInfo]:
    """The peer manager when the daemon has peers (--peers/--peers-dns/--peers-slurm), and
    its choices for `lpsync status` (empty on a single node)."""
    peers = config.peer_set()
    if peers is None:
        return None, pb.PeerPlaneInfo()
    secret = load_secret(config.secret_file or None)
    rdma = backends.Rdma.scan()
    transport, why = backends.resolve(config.peer_transport, rdma)
    # UCX makes its own sockets: no setting of ours reaches them.
    sockets = tcp_congestion.choose(config.peer_tcp_congestion) if transport == "tcp" else None
    tls, tls_why = backends.resolve_tls(config.ucx_tls, rdma)
    host_default = tcp_congestion.host_default()
    stall = tcp_congestion.ucx_over_bbr(transport, tls, host_default, bool(rdma.devices))
    if stall is not None:
        log.warning(stall)
    if sockets is not None and config.peer_tcp_congestion == tcp_congestion.AUTO and not sockets.setting:
        log.warning(f"peer sockets' TCP congestion control: {sockets.name} ({sockets.reason})")
    log.info(
        "peers",
        extra={
            "node_rank": peers.node_rank,
            "peers": ",".join(str(p) for p in peers.peers),
            "peer_transport": transport,
            "why": why,
            "tcp_congestion": f"{sockets.name} ({sockets.reason})" if sockets else "",
            "ucx_tls": (tls or "UCX's choice") + f" ({tls_why})" if transport == "ucx" else "",
        },
    )
    metrics.peer_transport.info({"transport": transport, "why": why})
    # How device chunks cross the peer plane: decided once, from what UCX reports here.
    device = backends.device_path(transport, parse_devices(config.devices).kind, tls, config.peer_device_path)
    log.info(
        "peer device path",
        extra={
            "device_path": device.path,
            "why": device.reason,
            "device_transports": ",".join(device.transports),
            "gpudirect_rdma": device.gpudirect_rdma,
        },
    )
    info = pb.PeerPlaneInfo(
        transport=transport,
        transport_reason=why,
        device_path=device.path,
        device_reason=device.reason,
        device_transports=device.transports,
        gpudirect_rdma=device.gpudirect_rdma,
        tcp_congestion=sockets.name if sockets else "",
        tcp_congestion_reason=sockets.reason if sockets else "",
        ucx_tls=tls if transport == "ucx" else "",
        ucx_tls_reason=tls_why if transport == "ucx" else "",
    )
    plane = PeerPlane(
        PeerPlaneOptions(
            peers,
            secret,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            tls=tls or None,
            agreement_radix=config.agreement_radix,
            transport=transport,
            tcp_congestion=sockets.setting if sockets else "",
        ),
        metrics,
    )
    return plane, info


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _catch_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> Callable[[], None]:
    """Have SIGTERM and SIGINT call ``stop`` on ``loop``; returns what ignores them from
    then on. Not loop.add_signal_handler: asyncio puts the default action back when it
    lets go of a handler, and a repeated SIGTERM (a supervisor's, a script's) landing
    between that and ignoring it killed a daemon that had stopped cleanly (exit -15).
    Here a handler goes straight to SIG_IGN. The wake-up socket wakes the loop where the
    signal lands on another thread than the one the loop runs on."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)

    def drain() -> None:
        with contextlib.suppress(OSError):
            reader.recv(4096)

    loop.add_reader(reader.fileno(), drain)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda _signum, _frame: loop.call_soon_threadsafe(stop))

    def ignore() -> None:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.set_wakeup_fd(previous)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()

    return ignore


def _watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, stop: Callable[[], None]) -> None:
    """Call ``stop`` once ``fd`` reaches end of file: every holder of the pipe's write end
    (the launcher) is gone (--lifeline-fd; lpsync.daemon.launch)."""
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            if os.read(fd, 4096):
                return  # the launcher wrote something: not an end
        except BlockingIOError:
            return
        except OSError:
            pass  # unreadable from now on: the same as gone
        loop.remove_reader(fd)
        log.warning("the process that started this daemon is gone (--lifeline-fd): stopping")
        stop()

    loop.add_reader(fd, readable)


async def _serve(config: DaemonConfig) -> Daemon:
    daemon = Daemon(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    ignore_stop_signals = _catch_stop_signals(loop, daemon.request_stop)
    if config.lifeline_fd != -1:
        _watch_lifeline(loop, config.lifeline_fd, daemon.request_stop)
    try:
        await daemon.wait()
    finally:
        await daemon.stop()
        ignore_stop_signals()  # stopped and cleaned up: a repeated SIGTERM changes nothing
        if config.lifeline_fd != -1:
            loop.remove_reader(config.lifeline_fd)
    return daemon


def serve(config: DaemonConfig) -> int:
    daemon = asyncio.run(_serve(config))
    if daemon.wedged:
        faulthandler.dump_traceback(all_threads=True)  # where it is stuck, into the log
    if daemon.wedged or backends.exit_needs_os_exit():
        # Sessions, shared memory and sockets are gone; what remains is UCX's: a thread
        # stuck inside a ucxx call (wedged), or the listener, worker and context that are
        # never destroyed while peers may dial (transport/ucx/progress.py). The
        # interpreter's finalization would free them under UCX's async thread (a crash).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
