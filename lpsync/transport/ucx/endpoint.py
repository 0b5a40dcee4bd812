"""The Endpoint of lpsync.engine.endpoint over UCX (ucxx), one per participant.

The mesh and its failure model are lpsync.transport.mesh's. Each connection is
authenticated over UCX stream messages; the handshake also gives both ends a session
key. Messages use UCX tag matching, which is per worker, not per connection: the wire
tag is the caller's tag mixed with the connection's session key (a bijection per
connection), so (peer, tag) pairs of different connections never meet, and a refused
peer cannot guess tags to inject.

Threads: every UCX call runs on the runtime's progress thread (progress.py); send and
recv_into hand it a closure and wait on a threading.Event with a deadline. Several
threads may use one endpoint at once (the daemon's participants and heartbeats).

``close`` is collective like MPI_Finalize: each side says goodbye and waits
(bounded) for the others' goodbyes before closing connections, so an eager message
still in flight is never lost to an early close.

Device memory (the direct path): a send or receive of a device span is posted with its
device current on the progress thread (device_support.claim: UCX's cuda transports
query the pointer and arm cuda events in the caller's context). ``abort`` returns only
once UCX let go of every buffer posted here (bounded): a failed collective answers its
error, and its plans free staging memory, after that, never while a receive can land.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpsync.errors import UnavailableError
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.auth import Recv, Send, client_handshake, server_handshake
from lpsync.transport.mesh import (
    Channel,
    InFlight,
    MeshEndpoint,
    MeshOptions,
    Request,
    bytes_view,
    port_open,
)
from lpsync.transport.tags import GOODBYE
from lpsync.transport.ucx.device_support import claim
from lpsync.transport.ucx.progress import ProgressThread
from lpsync.transport.ucx.runtime import RuntimeOptions, UcxRuntime

log = logging.getLogger("lpsync.ucx")

_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: tag -> key + tag * _MIX is a bijection mod 2**64
ABORT_RELEASE_S = 10.0  # how long abort waits for UCX to let go of posted buffers


@dataclass(frozen=True)
class UcxOptions(MeshOptions):
    # The next two only shape a runtime the endpoint makes itself (connect without one):
    tls: str | None = None  # UCX_TLS ("tcp" forces TCP); None: env/UCX default
    ucx_config: tuple[tuple[str, str], ...] = ()  # further UCX options, e.g. (("RNDV_THRESH", "64K"),)


class _Ep:
    """Holds one ucxx endpoint so that only the progress thread ever drops it.

    A ucxx endpoint whose last reference goes away runs ucxx's blocking close in its
    destructor, on whatever thread drops it, with the GIL held: off the progress thread
    that close progresses the worker beside our progress thread (which then cannot take
    the GIL), and a process could hang in it (the rebuild test's replacement once did).
    So threads that dial or accept hold this box, never the endpoint; ``ucx`` is set and
    cleared on the progress thread only, and ``close`` (on that thread) drops the endpoint.
    """

    __slots__ = ("__weakref__", "ucx")

    def __init__(self, ucx: Any, progress: ProgressThread) -> None:
        self.ucx: Any = ucx
        # Closed by the progress thread's teardown if nobody closed it before: an
        # endpoint that outlives its worker corrupts the heap when it is freed (seen when
        # every daemon of 16 stops while meshes form: SIGSEGV in progress, or an abort in
        # the interpreter's final garbage collection).
        progress.adopt(self)

    def get(self) -> Any:
        """The endpoint, on the progress thread; UnavailableError once closed."""
        ucx = self.ucx
        if ucx is None:
            raise UnavailableError("the connection is closed")
        return ucx

    def close(self) -> None:
        # On the progress thread.
        ucx, self.ucx = self.ucx, None
        if ucx is None:
            return
        try:
            ucx.remove_close_callback()
        except Exception as error:  # closing already: close it all the same
            log.debug("removing a UCX close callback: %s", error)
        ucx.close_blocking()


class _Conn:
    """One authenticated connection to a peer."""

    __slots__ = ("address", "departed", "ep", "goodbye", "key", "rank")

    def __init__(self, rank: int, address: PeerAddress, ep: _Ep, session: bytes) -> None:
        self.rank, self.address, self.ep = rank, address, ep
        self.key = int.from_bytes(session[:8], "little")
        self.departed = False  # said goodbye: its connection closing is no failure
        self.goodbye: Request | None = None

    def tag(self, tag: int) -> int:
        return (self.key + (tag & _MASK) * _MIX) & _MASK


class UcxEndpoint(MeshEndpoint):
    """One participant's connections to every other; build with ``UcxEndpoint.connect``."""

    options: UcxOptions

    def __init__(self, options: UcxOptions) -> None:
        super().__init__(options)
        self._conns: dict[int, _Conn] = {}
        self._runtime: UcxRuntime | None = None
        self._channels: dict[int, Channel] = {}  # made once per peer: a leaf asks per collective
        self._posted: set[Request] = set()  # sends and receives UCX still holds (abort waits)

    # -- setup ---------------------------------------------------------------------------

    def _own_runtime(self) -> UcxRuntime:
        o = self.options
        return UcxRuntime(RuntimeOptions(o.peers[self.rank].port, o.tls, o.ucx_config, o.connect_timeout))

    def _connect(self, peer: int, host: str, port: int, remaining: float, deadline: float) -> None:
        # UCX gives up on a port nobody listens on only after its whole connect timeout;
        # a plain TCP connect says "refused" at once, so wait for that first.
        if not port_open(host, port, min(1.0, remaining)):
            raise ConnectionRefusedError
        ep: _Ep | None = None
        try:
            ep = self._create_ep(host, port, remaining)
            send, recv = self._stream_io(ep, deadline)
            result = client_handshake(send, recv, self.options.secret, self.rank, expect_rank=peer)
            self._register(peer, ep, result.session)
        except BaseException:
            if ep is not None:
                self._close_ep(ep)
            raise

    def _create_ep(self, host: str, port: int, timeout: float) -> _Ep:
        """A UCX endpoint to host:port, made on the progress thread and boxed there (_Ep).
        One that arrives after we stopped waiting is closed on the progress thread too."""
        assert self._runtime is not None
        progress = self._runtime.progress
        future = progress.call(
            lambda: _Ep(progress.api.UCXEndpoint.create(progress.worker, host, port, True), progress)
        )
        try:
            return future.result(timeout)
        except TimeoutError:
            # The callback may run here or on the progress thread: it only posts the close.
            future.add_done_callback(
                lambda done: self._close_ep(done.result()) if done.exception() is None else None
            )
            raise

    def _on_accept(self, connection: Any) -> None:
        # On the progress thread: box the endpoint here (see _Ep).
        assert self._runtime is not None
        super()._on_accept(_Ep(connection, self._runtime.progress))

    def _accept(self, ep: _Ep) -> None:
        send, recv = self._stream_io(ep, time.monotonic() + self.options.handshake_timeout)
        where = f"listener :{self.options.peers[self.rank].port}"
        try:
            result = server_handshake(
                send, recv, self.options.secret, self.rank, where=where, admit=self._admit
            )
        except Exception as error:
            self._unfinished(error)
            self._close_ep(ep)
            return
        self._register(result.peer_rank, ep, result.session)

    def _stream_io(self, ep: _Ep, deadline: float) -> tuple[Send, Recv]:
        """Blocking send/recv over ``ep``'s UCX stream for the handshake (lpsync.transport.
        auth), every message bounded by ``deadline`` and the handshake timeout."""
        assert self._runtime is not None
        progress = self._runtime.progress
        limit = min(deadline, time.monotonic() + self.options.handshake_timeout)

        def finish(request: Request, what: str) -> None:
            remaining = limit - time.monotonic()
            if not request.event().wait(max(0.0, remaining)):
                raise TimeoutError(f"authentication: no {what} within the handshake timeout")
            if request.error is not None:
                raise UnavailableError(f"authentication: {what} failed: {request.error}")

        def send(data: bytes) -> None:
            buf = np.frombuffer(data, np.uint8).copy()
            finish(progress.submit(lambda: ep.get().stream_send(progress.array(buf)), buf), "send")

        def recv(size: int) -> bytes:
            buf = np.empty(size, np.uint8)
            finish(progress.submit(lambda: ep.get().stream_recv(progress.array(buf)), buf), "message")
            return buf.tobytes()

        return send, recv

    def _register(self, rank: int, ep: _Ep, session: bytes) -> None:
        assert self._runtime is not None
        conn = _Conn(rank, self.options.peers[rank], ep, session)
        progress = self._runtime.progress
        with self._formed:
            if rank in self._conns or self._closed:
                duplicate = True
            else:
                duplicate = False
                self._conns[rank] = conn
                self._formed.notify_all()
        if duplicate:
            self._close_ep(ep)
            return
        # The connection's next message from the peer is its goodbye (close()).
        progress.call(lambda: ep.get().set_close_callback(self._on_close, cb_args=(conn,)))
        bye = np.zeros(1, np.uint8)
        conn.goodbye = progress.submit(
            lambda: ep.get().tag_recv(progress.array(bye), progress.api.UCXXTag(conn.tag(GOODBYE))),
            bye,
            on_done=lambda request: self._on_goodbye(conn, request),
        )
        log.debug("rank %d: connected to rank %d at %s", self.rank, rank, conn.address)

    # -- peers leaving -------------------------------------------------------------------

    def _on_goodbye(self, conn: _Conn, request: Request) -> None:
        if request.error is None:
            conn.departed = True

    def _on_close(self, conn: _Conn) -> None:
        # On the progress thread, inside UCX progress: judge once the requests this
        # progress call finished are complete (a goodbye may arrive with the close).
        assert self._runtime is not None
        log.debug("rank %d: UCX reports the connection to rank %d closed", self.rank, conn.rank)
        self._runtime.progress.after_progress(lambda: self._judge_close(conn))

    def _judge_close(self, conn: _Conn) -> None:
        if not conn.departed:
            self._peer_gone(conn.rank, conn.address)

    # -- failure -------------------------------------------------------------------------

    def _close_connections(self) -> None:
        if self._runtime is not None:
            self._runtime.progress.call(self._close_all)

    def _close_all(self) -> None:
        # On the progress thread.
        for conn in list(self._conns.values()):
            conn.ep.close()

    def _close_ep(self, ep: _Ep) -> None:
        assert self._runtime is not None
        self._runtime.progress.call(ep.close)

    # -- the Endpoint interface ----------------------------------------------------------

    def _post(
        self,
        conn: _Conn,
        tag: int,
        data: np.ndarray,
        on_done: Callable[[Request], None] | None = None,
        *,
        recv: bool,
    ) -> Request:
        assert self._runtime is not None
        progress = self._runtime.progress
        buf = bytes_view(data)
        wire = progress.api.UCXXTag(conn.tag(tag))
        posted = self._posted
        ended: list[Callable[[], None]] = []

        def start() -> Any:
            ep = conn.ep.get()  # UnavailableError once closed: the endpoint broke
            ended.append(claim(buf))  # device memory: its device current, the transfer counted
            array = progress.array(buf)
            return ep.tag_recv(array, wire) if recv else ep.tag_send(array, wire)

        def done(request: Request) -> None:
            posted.discard(request)
            for end in ended:
                end()
            if on_done is not None:
                on_done(request)

        request = Request()
        posted.add(request)
        return progress.submit(start, buf, done, request=request)

    def abort(self, error: BaseException) -> None:
        """Break the endpoint (MeshEndpoint.abort), then wait, bounded, until UCX finished
        or cancelled every send and receive posted here: only then may the caller answer
        the error and free what the transfers named (a receive landing in freed device
        memory, or in a client's buffer it was told is free, otherwise)."""
        super().abort(error)
        runtime = self._runtime
        if runtime is None or not runtime.alive:
            return
        deadline = time.monotonic() + ABORT_RELEASE_S
        try:  # the close _fail posted has run (it cancels what is in flight)
            runtime.progress.call(self._close_all).result(ABORT_RELEASE_S)
        except Exception as failure:
            log.warning("rank %d: closing UCX connections on abort: %r", self.rank, failure)
        for request in list(self._posted):
            if not request.event().wait(max(0.0, deadline - time.monotonic())):
                log.error(
                    "rank %d: UCX still holds a posted buffer %.0f s after abort", self.rank, ABORT_RELEASE_S
                )
                return

    def send(self, peer: int, tag: int, data: np.ndarray) -> InFlight:
        request = self._post(self._conn(peer), tag, data, recv=False)
        return InFlight(self, request, peer, tag, sending=True)

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> InFlight:
        request = self._post(self._conn(peer), tag, out, recv=True)
        return InFlight(self, request, peer, tag, sending=False)

    def channel(self, peer: int) -> Channel:
        """``peer``'s connection as a Channel (lpsync.transport.mesh): its requests'
        ``on_done`` runs on the progress thread, so a small collective on a leaf of the
        agreement finishes there (agreement.agree_later); not for data flow."""
        conn = self._conn(peer)  # checks the endpoint first, every time
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = Channel(
                functools.partial(self._post, conn, recv=False),
                functools.partial(self._post, conn, recv=True),
                self._wait,
                data_flow=False,
            )
        return channel

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye, wait (bounded) for the others' goodbyes, close every connection,
        and the runtime if this endpoint made it. Idempotent; never raises for a broken
        endpoint."""
        if self._closed:
            return
        runtime = self._runtime
        with self._formed:
            self._closed = True
            conns = list(self._conns.values())
        if runtime is not None and runtime.alive:
            self._join_handshakes(time.monotonic())
            try:
                self._say_goodbye(conns)
            except Exception as error:  # closing anyway
                log.warning("rank %d: unclean UCX close: %s", self.rank, error)
            self._closing = True
            try:
                runtime.progress.call(self._close_all).result(5.0)
            except Exception as error:
                log.warning("rank %d: closing UCX connections: %s", self.rank, error)
            if self._owns_runtime:
                runtime.close()
        self._closing = True
        self._conns.clear()

    def _say_goodbye(self, conns: list[_Conn]) -> None:
        if self._broken is not None or not conns:
            return
        assert self._runtime is not None
        bye = np.zeros(1, np.uint8)
        sends = [self._post(conn, GOODBYE, bye, recv=False) for conn in conns if conn.ep.ucx is not None]
        deadline = time.monotonic() + self.options.close_timeout
        for request in sends:
            request.event().wait(max(0.0, deadline - time.monotonic()))
        self._late_goodbyes([conn.goodbye.event() for conn in conns if conn.goodbye is not None], deadline)
