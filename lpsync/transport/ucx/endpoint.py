"""The Endpoint of lpsync.engine.transport over UCX (ucxx), one per participant.

Mesh: participant ``rank`` listens on the port of its own entry in ``peers`` (through
its UcxRuntime) and dials every lower rank, so every pair shares exactly one UCX
endpoint. Each connection is authenticated (lpsync.transport.auth) over UCX stream
messages before it carries anything else; the handshake also gives both ends a session
key. Messages use UCX tag matching, which is per worker, not per connection: the wire
tag is the caller's tag mixed with the connection's session key (a bijection per
connection), so (peer, tag) pairs of different connections never meet, and a refused
peer cannot guess tags to inject.

Threads: every UCX call runs on the runtime's progress thread (progress.py); send and
recv_into hand it a closure and wait on a threading.Event with a deadline. Several
threads may use one endpoint at once (the daemon's participants and heartbeats).

Failure model: the endpoint is a communicator. A timeout, a peer lost (its UCX endpoint
errors or closes without saying goodbye) or any transport error *breaks* it: every wait,
now and later, raises that error, and all connections are closed — which cancels the
in-flight UCX requests (nothing writes into a caller's buffer afterwards) and makes the
other participants fail promptly too. Recovery is a new UcxEndpoint (on the same
runtime). ``close`` is collective like MPI_Finalize: each side says goodbye and waits
(bounded) for the others' goodbyes before closing connections, so an eager message
still in flight is never lost to an early close.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lpsync.errors import (
    CollectiveTimeoutError,
    ConfigError,
    InvalidArgumentError,
    LpsyncError,
    UnauthenticatedError,
    UnavailableError,
)
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.auth import Recv, Send, client_handshake, server_handshake
from lpsync.transport.ucx.progress import Request
from lpsync.transport.ucx.runtime import RuntimeOptions, UcxRuntime

log = logging.getLogger("lpsync.ucx")

_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: tag -> key + tag * _MIX is a bijection mod 2**64
GOODBYE = _MASK  # a control tag no caller uses (peer_plane's kinds stop far below 127)


@dataclass(frozen=True)
class UcxOptions:
    rank: int  # this participant's index into peers
    peers: tuple[PeerAddress, ...]  # every participant's listen address, in rank order
    secret: bytes = field(repr=False)  # the cluster secret (lpsync.transport.auth.load_secret)
    connect_timeout: float = 30.0  # the whole mesh must be up within this many seconds
    handshake_timeout: float = 5.0  # one connection: UCX wire-up plus authentication
    close_timeout: float = 5.0  # how long close() waits for the other participants' goodbyes
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

    __slots__ = ("ucx",)

    def __init__(self, ucx: Any) -> None:
        self.ucx: Any = ucx

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


class _InFlight:
    """A send (done once UCX no longer needs the span) or a posted receive (done once
    the message has landed)."""

    __slots__ = ("_owner", "_request", "_what")

    def __init__(self, owner: UcxEndpoint, request: Request, what: str) -> None:
        self._owner, self._request, self._what = owner, request, what

    def done(self) -> bool:
        return self._request.done

    def wait(self, deadline: float) -> None:
        self._owner._wait(self._request, deadline, self._what)


class UcxEndpoint:
    """One participant's connections to every other; build with ``UcxEndpoint.connect``."""

    def __init__(self, options: UcxOptions) -> None:
        if not 0 <= options.rank < len(options.peers):
            raise ConfigError(f"rank {options.rank} is not an index into {len(options.peers)} peers")
        self.options = options
        self.rank, self.size = options.rank, len(options.peers)
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._formed = threading.Condition(self._lock)
        self._handshakes: list[threading.Thread] = []
        self._waiters: set[threading.Event] = set()
        self._broken: LpsyncError | None = None
        self._closing = False
        self._closed = False
        self._staging = np.empty(0, np.uint8)
        self._runtime: UcxRuntime | None = None
        self._owns_runtime = False

    # -- setup ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, options: UcxOptions, runtime: UcxRuntime | None = None) -> UcxEndpoint:
        """Dial the lower ranks, accept the higher ones, authenticate all. Without
        ``runtime`` the endpoint makes its own (listening on its entry's port) and closes
        it with itself. Raises CollectiveTimeoutError naming the missing ranks,
        UnauthenticatedError on a refusal."""
        endpoint = cls(options)
        try:
            endpoint._start(runtime)
        except BaseException:
            endpoint.close()
            raise
        return endpoint

    def _start(self, runtime: UcxRuntime | None) -> None:
        opts = self.options
        deadline = time.monotonic() + opts.connect_timeout
        if runtime is None:
            runtime = UcxRuntime(RuntimeOptions(opts.peers[self.rank].port, opts.tls,
                                                opts.ucx_config, opts.connect_timeout))
            self._owns_runtime = True
        if not runtime.alive:
            raise UnavailableError("the UCX runtime is closed")
        self._runtime = runtime
        runtime.set_acceptor(self._on_accept)
        try:
            errors: list[BaseException] = []
            dialers = [threading.Thread(target=self._dial_guarded, args=(peer, deadline, errors),
                                        name=f"lpsync-ucx-dial-{peer}", daemon=True)
                       for peer in range(self.rank)]
            for thread in dialers:
                thread.start()
            for thread in dialers:
                thread.join(max(0.0, deadline - time.monotonic()) + opts.handshake_timeout)
            if errors:
                raise errors[0]
            with self._formed:
                while len(self._conns) < self.size - 1 and self._broken is None:
                    if not runtime.alive:
                        raise UnavailableError("the UCX runtime was closed while connecting")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = [r for r in range(self.size)
                                   if r != self.rank and r not in self._conns]
                        raise CollectiveTimeoutError(
                            f"rank {self.rank}: ranks {missing} did not connect within "
                            f"{opts.connect_timeout:.0f} s (started? same --peers list? "
                            "a firewall?)")
                    self._formed.wait(min(remaining, 0.5))
            self._check()
        finally:
            runtime.set_acceptor(None)
            self._join_handshakes(deadline)

    def _dial_guarded(self, peer: int, deadline: float, errors: list[BaseException]) -> None:
        try:
            self._dial(peer, deadline)
        except BaseException as error:
            errors.append(error)

    def _dial(self, peer: int, deadline: float) -> None:
        assert self._runtime is not None
        address = self.options.peers[peer]
        host = _resolve(address.host)
        pause, last = 0.05, "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if not self._runtime.alive:
                raise UnavailableError("the UCX runtime was closed while connecting")
            if remaining <= 0:
                raise CollectiveTimeoutError(f"rank {self.rank} could not reach rank {peer} at "
                                             f"{address} ({last})")
            # UCX gives up on a port nobody listens on only after its whole connect
            # timeout; a plain TCP connect says "refused" at once, so wait for that first.
            if _port_open(host, address.port, min(1.0, remaining)):
                ep: _Ep | None = None
                try:
                    ep = self._create_ep(host, address.port, remaining)
                    send, recv = self._stream_io(ep, deadline)
                    result = client_handshake(send, recv, self.options.secret, self.rank,
                                              expect_rank=peer)
                    self._register(peer, ep, result.session)
                    return
                except UnauthenticatedError:
                    if ep is not None:
                        self._close_ep(ep)
                    raise
                except Exception as error:
                    if ep is not None:
                        self._close_ep(ep)
                    # Not listening yet, or no mesh forming there yet (it closes us before
                    # the verdict): retry until the deadline. A refusal stays final.
                    last = f"{type(error).__name__}: {error}"
            else:
                last = "connection refused"
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(1.0, pause * 2)

    def _create_ep(self, host: str, port: int, timeout: float) -> _Ep:
        """A UCX endpoint to host:port, made on the progress thread and boxed there (_Ep).
        One that arrives after we stopped waiting is closed on the progress thread too."""
        assert self._runtime is not None
        progress = self._runtime.progress
        future = progress.call(lambda: _Ep(progress.api.UCXEndpoint.create(
            progress.worker, host, port, True)))
        try:
            return future.result(timeout)
        except TimeoutError:
            # The callback may run here or on the progress thread: it only posts the close.
            future.add_done_callback(
                lambda done: done.exception() is None and self._close_ep(done.result()))
            raise

    def _on_accept(self, ucx: Any) -> None:
        # On the progress thread: box the endpoint here (see _Ep) and authenticate on a
        # thread of its own (it waits for messages).
        ep = _Ep(ucx)
        thread = threading.Thread(target=self._accept, args=(ep,), daemon=True,
                                  name=f"lpsync-ucx-accept-r{self.rank}")
        with self._lock:
            self._handshakes.append(thread)
        thread.start()

    def _accept(self, ep: _Ep) -> None:
        send, recv = self._stream_io(ep, time.monotonic() + self.options.handshake_timeout)
        where = f"listener :{self.options.peers[self.rank].port}"
        try:
            result = server_handshake(send, recv, self.options.secret, self.rank, where=where,
                                      admit=self._admit)
        except Exception as error:
            if not isinstance(error, UnauthenticatedError):
                # A peer holding another secret rejects our proof and hangs up here.
                log.warning("rank %d: refused a connection at :%d: it left authentication "
                            "unfinished (%s: %s); a peer with another secret does that",
                            self.rank, self.options.peers[self.rank].port,
                            type(error).__name__, error)
            self._close_ep(ep)
            return
        self._register(result.peer_rank, ep, result.session)

    def _admit(self, rank: int) -> str | None:
        if not self.rank < rank < self.size:
            return (f"rank {rank} should not dial rank {self.rank} (higher ranks dial lower "
                    f"ones; {self.size} participants)")
        if rank in self._conns:
            return f"rank {rank} is already connected"
        return None

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
            lambda: ep.get().tag_recv(progress.array(bye),
                                      progress.api.UCXXTag(conn.tag(GOODBYE))),
            bye, on_done=lambda request: self._on_goodbye(conn, request))
        log.debug("rank %d: connected to rank %d at %s", self.rank, rank, conn.address)

    def _join_handshakes(self, deadline: float) -> None:
        with self._lock:
            threads, self._handshakes = self._handshakes, []
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + self.options.handshake_timeout)

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
        if self._closing or conn.departed:
            return
        self._fail(UnavailableError(f"peer rank {conn.rank} at {conn.address} is gone: its "
                                    "connection failed or closed mid-collective"))

    # -- failure -------------------------------------------------------------------------

    def _fail(self, error: LpsyncError) -> None:
        """Break the endpoint with ``error`` (the first one wins) and wake every waiter."""
        with self._formed:
            if self._broken is not None:
                return
            self._broken = error
            waiters = list(self._waiters)
            self._formed.notify_all()
        for event in waiters:
            event.set()
        log.warning("rank %d: %s", self.rank, error)
        if not self._closing and self._runtime is not None:
            # Closing cancels in-flight requests and tells the peers at once.
            self._runtime.progress.call(self._close_all)

    def abort(self, error: BaseException) -> None:
        """Break the endpoint from outside (a heartbeat watchdog that declared a peer
        gone, a collective that failed with receives posted): every wait raises
        ``error`` (an LpsyncError; anything else as UnavailableError), unless something
        broke it first."""
        self._fail(error if isinstance(error, LpsyncError)
                   else UnavailableError(f"rank {self.rank}: aborted: {error!r}"))

    @property
    def error(self) -> LpsyncError | None:
        """What broke this endpoint (a lost peer, a timeout), or None while it is healthy;
        set as soon as UCX reports a peer gone, even when nothing was waiting on it."""
        return self._broken

    def _close_all(self) -> None:
        # On the progress thread.
        for conn in list(self._conns.values()):
            conn.ep.close()

    def _close_ep(self, ep: _Ep) -> None:
        assert self._runtime is not None
        self._runtime.progress.call(ep.close)

    def _check(self) -> None:
        broken = self._broken
        if broken is not None:
            # A fresh instance per raise: one shared exception would pile up tracebacks.
            raise type(broken)(*broken.args)
        if self._closed:
            raise UnavailableError(f"rank {self.rank}'s UCX endpoint is closed")

    def _conn(self, peer: int) -> _Conn:
        self._check()
        try:
            return self._conns[peer]
        except KeyError:
            raise InvalidArgumentError(f"rank {self.rank} has no peer rank {peer} "
                                       f"({self.size} participants)") from None

    def _wait(self, request: Request, deadline: float, what: str) -> None:
        """Wait for ``request`` until ``deadline``; waking early when the endpoint breaks."""
        if not request.done:
            event = request.event()
            with self._lock:
                self._waiters.add(event)
            try:
                while not request.done:
                    self._check()
                    remaining = deadline - time.monotonic()
                    if (remaining <= 0 or not event.wait(remaining)) and not request.done:
                        self._fail(CollectiveTimeoutError(
                            f"rank {self.rank} timed out waiting for {what}"))
                        self._check()
            finally:
                with self._lock:
                    self._waiters.discard(event)
        error = request.error
        if error is None:
            return
        self._check()  # cancelled because the endpoint broke: report why it broke
        if type(error).__name__ in ("UCXMessageTruncatedError", "UCXMsgTruncated"):
            raise InvalidArgumentError(f"{what}: the message is larger than the receive "
                                       "buffer (mismatched counts across participants?)")
        self._fail(UnavailableError(f"{what} failed: {type(error).__name__}: {error}"))
        self._check()

    # -- the Endpoint interface ----------------------------------------------------------

    def _post(self, conn: _Conn, tag: int, data: np.ndarray, recv: bool) -> Request:
        assert self._runtime is not None
        progress = self._runtime.progress
        buf = _bytes_view(data)
        wire = progress.api.UCXXTag(conn.tag(tag))

        def start() -> Any:
            ep = conn.ep.get()  # UnavailableError once closed: the endpoint broke
            array = progress.array(buf)
            return ep.tag_recv(array, wire) if recv else ep.tag_send(array, wire)

        return progress.submit(start, buf)

    def send(self, peer: int, tag: int, data: np.ndarray) -> _InFlight:
        request = self._post(self._conn(peer), tag, data, recv=False)
        return _InFlight(self, request, f"send of message {tag} to rank {peer}")

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> _InFlight:
        request = self._post(self._conn(peer), tag, out, recv=True)
        return _InFlight(self, request, f"message {tag} from rank {peer}")

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        self.post_recv(peer, tag, out).wait(deadline)

    @contextmanager
    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float) -> Iterator[np.ndarray]:
        # One staging buffer, reused: the executor holds at most one borrow at a time.
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        view = self._staging[:nbytes]
        self.recv_into(peer, tag, view, deadline)
        lent = view.view()
        lent.flags.writeable = False
        yield lent

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
        late = 0
        for conn in conns:
            goodbye = conn.goodbye
            if goodbye is not None and not goodbye.event().wait(
                    max(0.0, deadline - time.monotonic())):
                late += 1
        if late:
            log.warning("rank %d: no goodbye from %d peer(s) within %.0f s; closing anyway",
                        self.rank, late, self.options.close_timeout)

    def __enter__(self) -> UcxEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_view(data: np.ndarray) -> np.ndarray:
    if not data.flags.c_contiguous:
        raise InvalidArgumentError("UCX sends and receives contiguous spans only")
    return data.reshape(-1).view(np.uint8)


def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _resolve(host: str) -> str:
    """UCX wants a numeric address; resolve names (IPv4 first) here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"cannot resolve peer host {host!r}: {error}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])

