"""The lpsync client: attach to the node's daemon, place buffers in shared memory and run
collectives over them.

    import lpsync_client
    with lpsync_client.connect() as client:          # RANK, WORLD_SIZE, LPSYNC_JOB... from env
        grads = client.zeros(1 << 20, "float32")     # lives in shared memory: zero copy
        grads[:] = 1.0
        client.allreduce(grads)                      # in place, sum over the job's ranks
        t = torch.ones(10)                           # anything else is staged transparently
        client.allreduce(client.register(t), op="avg")

Every collective blocks until it completes; each has an ``*_async`` twin that returns a
concurrent.futures.Future. Collectives must be issued in the same order on every rank
(they are matched by a per-job sequence number). Errors are typed (lpsync_client.errors).
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import grpc

from lpsync_client import _ops, layout
from lpsync_client._hot import HotPath
from lpsync_client._operands import Buffers, DeviceRegistered, Registered
from lpsync_client._p2p import PairJobs
from lpsync_client._stream import SessionStream
from lpsync_client._trigger import TriggerStream
from lpsync_client.errors import (
    InvalidArgumentError,
    LpsyncError,
    from_status,
)
from lpsync_client.wire import DEFAULT_SOCKET
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 300.0
__all__ = ["DEFAULT_SOCKET", "DEFAULT_TIMEOUT", "Client", "DeviceRegistered", "Registered", "connect"]


def _ready(channel: grpc.Channel, where: str, tcp: bool, timeout: float) -> None:
    """Wait until the daemon answers; UnavailableError saying why not."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        reason = None if tcp else _refusal(where)
        raise from_status(
            "UNAVAILABLE", f"no lpsync daemon answers at {where} ({reason or 'is it running?'})"
        ) from None


def _node(info: pb.NodeInfo) -> layout.Node:
    return layout.Node(info.node_rank, info.nodes or 1, info.cluster)


class Client(Buffers, HotPath):
    """One attached rank. Prefer :func:`connect`, which reads torchrun's environment.
    ``node`` is the daemon it attached to (node rank, node count, cluster); ``rank_nodes``
    the node of every rank when they were discovered through a store (else None)."""

    def __init__(
        self,
        *,
        socket: str | None = None,
        target: str | None = None,
        job: str,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 10.0,
        trigger: str = "auto",
        store: layout.Store | None = None,
        rank_nodes: Sequence[int] | None = None,
    ) -> None:
        """``rank_nodes``: the node of every rank, known already (a pair job of send/recv
        takes its ranks' nodes from its main job); ``store``: discover them."""
        if trigger not in ("auto", "grpc", "socket"):
            raise InvalidArgumentError(f"trigger must be 'auto', 'grpc' or 'socket', got {trigger!r}")
        self.job, self.rank, self.world_size = job, rank, world_size
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if target:  # TCP: the daemon only listens there with TLS
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, credentials)
        else:
            self._channel = grpc.insecure_channel(f"unix:{socket or DEFAULT_SOCKET}")
        self._stub = pb_grpc.LpSyncStub(self._channel)
        # Buffers and registrations (_operands.py, which documents each).
        self._segments, self._device, self._scratch = {}, {}, {}
        self._dead = queue.SimpleQueue()
        self._reaper = None
        self._lock = threading.Lock()
        self._init_hot()  # the hot path's state (_hot.py)
        self._closed = False
        self._store: layout.Store | None = None  # the layout's store, once discovered
        where = target or socket or DEFAULT_SOCKET
        # What a pair job of send/recv attaches with (_p2p.py): this client's daemon.
        self._settings: dict[str, Any] = {
            "socket": socket,
            "target": target,
            "token": token,
            "root_certificates": root_certificates,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "trigger": trigger,
        }

        def ask() -> layout.Node:
            _ready(self._channel, where, bool(target), connect_timeout)
            return _node(self._call(self._stub.Node, pb.NodeRequest(), connect_timeout))

        try:
            if rank_nodes is not None:  # known (a pair job): nothing to discover
                _ready(self._channel, where, bool(target), connect_timeout)
                hints = layout.Hints(local_rank or 0, local_world_size or 0)
                rank_nodes = list(rank_nodes)
            elif store is not None:  # discovered: local_rank/local_world_size are hints
                hints = layout.Hints(local_rank or 0, local_world_size or 0)
                # A daemon that does not answer is published too: the other ranks fail at once.
                rank_nodes = layout.discover(store, f"lpsync/layout/{job}", job, rank, world_size, ask, hints)
                # Held while the client lives: rank 0's may host the store (a TCPStore made
                # for connect() alone), and the other ranks may still be reading the table.
                self._store = store
            else:  # claimed: node-major from local_world_size; without it, the daemons find it
                _ready(self._channel, where, bool(target), connect_timeout)
                hints = layout.Hints(
                    0 if local_world_size is None else local_rank or 0,
                    local_world_size or 0,
                )
                rank_nodes = []
            attached = self._call(
                self._stub.Attach,
                pb.AttachRequest(
                    job=job,
                    rank=rank,
                    world_size=world_size,
                    local_rank=hints.local_rank,
                    local_world_size=hints.local_world_size,
                    pid=os.getpid(),
                    rank_nodes=rank_nodes,
                ),
                connect_timeout,
            )
            self.session_id = attached.session_id
            # The daemon this rank attached to, and the node of every rank when discovered.
            self.node = _node(attached.node)
            self.rank_nodes: list[int] | None = list(rank_nodes) or None
            per_node = hints.local_world_size
            self._p2p = PairJobs(
                job,
                rank,
                world_size,
                # The node of a rank: discovered, node-major by LOCAL_WORLD_SIZE, or unknown
                # here (-1: the daemons find it, as for this job).
                lambda r: self.rank_nodes[r] if self.rank_nodes else r // per_node if per_node else -1,
                self._open_pair,
            )
            self._stream = SessionStream(self._stub, self.session_id, self._metadata, connect_timeout)
            # Collectives and pings go through the trigger socket when asked for (and
            # offered); the gRPC stream above stays open either way: it is the lifeline.
            self._trigger: TriggerStream | None = None
            if trigger == "socket" and not attached.trigger_socket:
                raise from_status(
                    "UNAVAILABLE", "the daemon offers no trigger socket (TCP, or started with --no-trigger)"
                )
            # auto never leaves a TCP connection for a local socket: the daemon may be remote.
            if attached.trigger_socket and (trigger == "socket" or (trigger == "auto" and not target)):
                try:
                    self._trigger = TriggerStream(attached.trigger_socket, self.session_id, connect_timeout)
                except LpsyncError:
                    if trigger == "socket":
                        raise
                    # auto: e.g. the socket is not reachable from this container; gRPC works
            self._path = self._trigger or self._stream
            self.trigger = "socket" if self._trigger is not None else "grpc"
        except BaseException:
            self._channel.close()
            raise

    # -- collectives: the hot path is HotPath's (_hot.py) ------------------------------
    # Each call: its *_async method here, its blocking twin made from the table (_ops.py).
    def allreduce_async(
        self,
        x,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        """Start an allreduce; the Future's result is the output (``out`` or ``x``)."""
        return self._start("allreduce", x, out, 0, op, algorithm, timeout, name)

    def broadcast_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("broadcast", x, out, root, "", algorithm, timeout, name)

    def reduce_async(
        self,
        x,
        root: int = 0,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("reduce", x, out, root, op, algorithm, timeout, name)

    def allgather_async(
        self, x, out=None, algorithm: str | None = None, timeout: float | None = None, name: str = ""
    ) -> Future:
        return self._start("allgather", x, out, 0, "", algorithm, timeout, name)

    def reduce_scatter_async(
        self,
        x,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("reduce_scatter", x, out, 0, op, algorithm, timeout, name)

    def gather_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("gather", x, out, root, "", algorithm, timeout, name)

    def scatter_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("scatter", x, out, root, "", algorithm, timeout, name)

    def alltoall_async(
        self, x, out, algorithm: str | None = None, timeout: float | None = None, name: str = ""
    ) -> Future:
        return self._start("alltoall", x, out, 0, "", algorithm, timeout, name)

    def barrier_async(self, timeout: float | None = None, name: str = "") -> Future:
        return self._start("barrier", None, None, timeout=timeout, name=name)

    def send_async(self, x, dst: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self._p2p.send(x, dst, tag, timeout, getattr(self._here, "p2p_now", False))

    def recv_async(self, x, src: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self._p2p.recv(x, src, tag, timeout, getattr(self._here, "p2p_now", False))

    def recv_any_async(self, x, tag: int = 0, timeout: float | None = None) -> Future:
        """A Future of the sending rank; ``x`` holds its message once it completes."""
        return self.any_source_async(tag, lambda source: self._p2p.recv(x, source, tag, timeout), timeout)

    allreduce = _ops.blocking(allreduce_async)
    broadcast = _ops.blocking(broadcast_async)
    reduce = _ops.blocking(reduce_async)
    allgather = _ops.blocking(allgather_async)
    reduce_scatter = _ops.blocking(reduce_scatter_async)
    gather = _ops.blocking(gather_async)
    scatter = _ops.blocking(scatter_async)
    alltoall = _ops.blocking(alltoall_async)
    barrier = _ops.blocking(barrier_async)
    send = _ops.blocking(send_async)
    recv = _ops.blocking(recv_async)
    recv_any = _ops.blocking(recv_any_async)

    def any_source_async(
        self, tag: int, issue: Callable[[int], Future | None], timeout: float | None = None
    ) -> Future:
        """For adapters that receive a message in pieces: find the rank whose message with
        ``tag`` comes next, then call ``issue(rank)``, which issues the receives from it
        (``recv_async``) and returns a Future done when they are (or None); in order with
        this tag's other receives from any source. A Future of the rank."""
        timeout = self.timeout if timeout is None else timeout

        def receive() -> tuple[int, Future | None]:
            source = cast(int, self._wait(self._probe(tag, timeout), timeout))
            return source, issue(source)

        return self._p2p.any_source(tag, receive)

    def _probe(self, tag: int, timeout: float) -> Future:
        """Ask the daemon which rank's message with ``tag`` comes next (pb.Probe)."""
        issued = self._p2p.issued(tag)
        message = pb.SessionRequest(
            probe=pb.Probe(tag=tag, sources=list(issued), issued=list(issued.values()), timeout=timeout)
        )

        def complete(response: pb.SessionResponse) -> int:
            if response.WhichOneof("body") == "probed":
                return response.probed.source
            r = response.result
            raise from_status(r.code, r.message, r.error, "")

        return self._path.submit(message, complete)

    def _open_pair(self, job: str, rank: int, rank_nodes: list[int]) -> Client:
        """Attach a pair job of send/recv (_p2p.py) to this client's daemon."""
        if -1 in rank_nodes:  # unknown here: the daemons find the pair's layout
            return Client(**self._settings, job=job, rank=rank, world_size=2)
        local = sum(1 for n in rank_nodes if n == rank_nodes[rank])
        return Client(
            **self._settings,
            job=job,
            rank=rank,
            world_size=2,
            local_rank=rank if local == 2 else 0,
            local_world_size=local,
            rank_nodes=rank_nodes if rank_nodes[0] != rank_nodes[1] else None,
        )

    def ping(self, timeout: float = 10.0, via: str | None = None) -> None:
        """One empty round trip: on the path collectives take (default), or ``via="grpc"``
        (the gRPC Session stream) or ``via="socket"`` (the trigger socket)."""
        path = {None: self._path, "grpc": self._stream, "socket": self._trigger}[via]
        if path is None:
            raise InvalidArgumentError("this client has no trigger socket")
        path.submit(pb.SessionRequest(ping=pb.Ping()), lambda r: None).result(timeout)

    def status(self, recent: int = 0) -> pb.StatusResponse:
        """The daemon's status; ``recent``: also its last collectives (up to that many)."""
        return self._call(self._stub.Status, pb.StatusRequest(recent=recent))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Detach: the daemon frees this client's buffers; arrays from empty() stay
        readable in this process until dropped (their memory is no longer shared)."""
        if self._closed:
            return
        self._closed = True
        reaper = self._reaper
        if reaper is not None:  # (its pending releases: the Detach below frees them all)
            self._dead.put(None)
            if reaper is not threading.current_thread():
                reaper.join(5.0)
        self._p2p.close()
        self._stop_hot()  # what is queued to ring is answered first (or times out)
        # The daemon may be gone or have ended the session already: nothing to free then.
        with contextlib.suppress(Exception):
            self._call(self._stub.Detach, pb.DetachRequest(session_id=self.session_id), 10.0)
        if self._trigger is not None:
            self._trigger.close()
        self._stream.close()
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._scratch.clear()
            self._device.clear()  # the daemon closed its mappings; the arrays are ours
            bells = self._forget_plans()
        for segment in segments:
            segment.mapping.close()
        for page in bells:
            page.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refusal(path: str) -> str | None:
    """Why this process may not connect to the daemon's Unix socket, if the kernel says
    so (the socket's mode 0660 admits its owner and group only)."""
    import socket as sk

    with sk.socket(sk.AF_UNIX, sk.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except PermissionError:
            try:
                st = os.stat(path)
                owner = f"mode {st.st_mode & 0o777:o}, uid {st.st_uid}, gid {st.st_gid}"
            except OSError:
                owner = "its directory is not searchable"
            return (
                f"permission denied for uid {os.getuid()} ({owner}): the daemon admits "
                "its own user and the socket's group"
            )
        except OSError:
            return None
    return None


def _connect_timeout(given: float | None, raw: str | None) -> float:
    """``given``, else LPSYNC_CONNECT_TIMEOUT's seconds, else 10; finite and positive."""
    where = "connect_timeout"
    value: float = 10.0
    if given is not None:
        value = given
    elif raw:
        where = f"LPSYNC_CONNECT_TIMEOUT={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{where}: the seconds to wait for the daemon must be a number above 0")
    return value


def connect(
    socket: str | None = None,
    *,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    target: str | None = None,
    token: str | None = None,
    root_certificates: bytes | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    trigger: str | None = None,
    store: layout.Store | None = None,
    connect_timeout: float | None = None,
) -> Client:
    """Attach to the node's daemon. Unset arguments come from the environment as torchrun
    sets it: LPSYNC_SOCKET, LPSYNC_JOB, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    (and LPSYNC_TARGET / LPSYNC_TOKEN for TCP). ``timeout`` is the default collective
    timeout in seconds. ``connect_timeout`` (or LPSYNC_CONNECT_TIMEOUT; default 10) is how
    many seconds to wait for the daemon to answer: longer where training may start before
    its daemon does, shorter to fail fast. ``trigger`` (or LPSYNC_TRIGGER) picks the path of collectives:
    "socket" the daemon's trigger socket (the Session messages without gRPC: several
    times lower latency for small collectives), "grpc" the gRPC Session stream, "auto"
    (default) the socket when the daemon offers one (Unix socket), else gRPC.

    Which node serves each rank needs no saying: daemons that are peers tell each other
    which ranks attached to them and settle the job's layout before its first collective
    (any launcher, any numbering of ranks, any number of ranks per node).
    LOCAL_RANK / LOCAL_WORLD_SIZE, where set, are hints the daemons check (node-major:
    RANK = node * LOCAL_WORLD_SIZE + LOCAL_RANK), never trusted over what they saw.
    ``store``: a store every rank of the job reaches (``set(key, bytes)``, ``get(key)``
    waiting for the key; torch.distributed's TCPStore and FileStore qualify), fresh for
    the job or under a job name of its own: the ranks then also exchange the layout
    themselves before attaching (lpsync_client.layout), each rank knows it
    (``Client.rank_nodes``), and daemons that are not peers are found out at once.

    >>> with lpsync_client.connect(job="demo", rank=0, world_size=2) as client:
    ...     client.allreduce(client.zeros(8))
    """
    env = os.environ

    def pick(value, name: str, default=None, cast=str):
        if value is not None:
            return value
        raw = env.get(name)
        if raw is None or raw == "":
            if default is None:
                raise InvalidArgumentError(f"{name} is not set; pass it to connect()")
            return default
        return cast(raw)

    rank = pick(rank, "RANK", cast=int)
    world_size = pick(world_size, "WORLD_SIZE", cast=int)
    # Hints only (0 where the launcher said nothing): the daemons check them.
    local_world_size = pick(local_world_size, "LOCAL_WORLD_SIZE", 0, int)
    local_rank = pick(local_rank, "LOCAL_RANK", 0, int) if local_world_size else 0
    return Client(
        socket=pick(socket, "LPSYNC_SOCKET", DEFAULT_SOCKET),
        target=target or env.get("LPSYNC_TARGET") or None,
        job=pick(job, "LPSYNC_JOB", "default"),
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size or None,
        token=token or env.get("LPSYNC_TOKEN") or None,
        root_certificates=root_certificates,
        timeout=timeout,
        trigger=trigger or env.get("LPSYNC_TRIGGER") or "auto",
        store=store,
        connect_timeout=_connect_timeout(connect_timeout, env.get("LPSYNC_CONNECT_TIMEOUT")),
    )
